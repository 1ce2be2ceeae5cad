"""Where serving time goes, step by step: each launched step's kind and label, its wall time (from
its launch to the next), its device time, and with --step-log one JSON line with what it held.

A step's wall time is known only when the next one launches (or the scheduler goes idle), so a
launch is recorded here and booked then (StepClock, StepLog, the counters' <kind>_step_ms, and in
ShadowKV mode the rates its tier rule reads: scheduler/tier_choice.py).
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import torch

from sglang_shadowkv.model_executor.forward_batch import StepItem

from .counters import DeviceStepTimer, StepClock, StepCounters, StepLog
from .tier_choice import Rates, decode_reads


class LaunchRecord(NamedTuple):
    """A launched step as the step clock, the step log and the tier rule's rates book it once the
    next launch ends its time."""
    kind: str
    label: str
    started: float
    prompt_tokens: int
    decode_rows: int
    detail: dict | None  # the step log's fields (None: no step log)
    reads: tuple[int, int] | None  # (dense KV tokens its decode rows read, rows over compressed chunks)


def step_kind(prompt_items: list[StepItem]) -> str:
    """What a step's prompt chunks make it, for the step clock: decode_only (none), suffix (all
    follow a compressed prefix: questions on compressed documents) or prefill."""
    if not prompt_items:
        return "decode_only"
    compressed = all(it.over_compressed_prefix for it in prompt_items)
    return "suffix" if compressed else "prefill"


def step_label(kind: str, decode_items: list[StepItem], prompt_items: list[StepItem]) -> str:
    """The step's kind with what else it held (StepClock): decodes beside prompt chunks, a prompt
    compressing at its prefill (read before the launch, which settles the compression)."""
    label = kind + ("+decode" if decode_items and prompt_items else "")
    return label + ("+compress" if any(it.shadowkv is not None and it.shadowkv.compress_now
                                        for it in prompt_items) else "")


class StepTimes:
    def __init__(self, counters: StepCounters, device: torch.device, step_log: str | None, rates: Rates | None):
        """rates: ShadowKV's measured rates (tier_choice.py), fed each booked step (None: none)."""
        self.counters, self.rates = counters, rates
        self.clock = StepClock()
        self.device_timer = DeviceStepTimer(self.clock, device)
        self.log = StepLog(step_log)
        self._last: LaunchRecord | None = None

    @contextlib.contextmanager
    def launch(self, now: float, decode_items: list[StepItem], prompt_items: list[StepItem],
               detail: Callable[[], dict]):
        """Around a step's launch: count its kind, remember it for booking, time it on the device.
        detail(): the step log's fields, asked for only with a step log."""
        kind = step_kind(prompt_items)
        self.counters.prefill_steps += kind != "decode_only"
        self.counters.suffix_steps += kind == "suffix"
        label = step_label(kind, decode_items, prompt_items)
        self._last = LaunchRecord(kind, label, now, sum(it.num_new for it in prompt_items), len(decode_items),
                                  detail() if self.log.file else None,
                                  decode_reads(decode_items) if self.rates is not None else None)
        started = self.device_timer.start()
        yield
        self.device_timer.stop(label, started)

    def book_last(self, now: float) -> None:
        """Book the time since the last launch to its kind of step and its label."""
        last = self._last
        if last is not None:
            ms = round(1000 * (now - last.started))
            name = last.kind + "_step_ms"
            setattr(self.counters, name, getattr(self.counters, name) + ms)
            self.clock.book(last.label, ms, last.prompt_tokens, last.decode_rows)
            if last.detail is not None:
                self.log.write(last.started, last.label, ms, last.detail)
            if self.rates is not None:
                self._observe(last, now - last.started)
        self._last = None

    def _observe(self, last: LaunchRecord, seconds: float) -> None:
        """The rates from steps of one kind only: a prefill without decodes or compression (prompt
        tokens a second), a step of decodes only (the decode fit)."""
        if last.label == "prefill":
            self.rates.observe_prefill(seconds, last.prompt_tokens)
        elif last.kind == "decode_only":
            self.rates.observe_decode(seconds, *last.reads)


def step_detail(cache, prefill_items: list[StepItem], decode_items: list[StepItem],
                queues: tuple[int, int, int]) -> dict:
    """What the step log says of a step besides its label and time (see StepLog); queues: the
    requests waiting, prefilling and decoding at its launch."""
    chunks = [[it.start, it.num_new, it.over_compressed_prefix] for it in prefill_items]
    tier = cache.compressed
    detail = {"chunks": chunks, "decode_rows": len(decode_items), "waiting": queues[0],
              "prefilling": queues[1], "decoding": queues[2],
              "pages": {"unused": cache.pool.num_unused, "lent": cache.pool.lent,
                        "reserved": cache.reserved_pages, "cached": cache.tree.evictable_pages}}
    if tier is not None:  # cumulative: a drop between two lines is a segment's GPU values given back
        detail["gpu_values"] = [tier.counters.gpu_value_loads, tier.counters.gpu_value_drops]
        sparse = [it.shadowkv.layout for it in decode_items if it.over_compressed_prefix]
        # decode rows over compressed chunks, and those of them whose values all sit in HBM (the
        # rest gather their missed chunks' values over PCIe)
        detail["sparse_rows"] = [len(sparse), sum(all(seg.value_pages for seg in lay.segments) for lay in sparse)]
    return detail
