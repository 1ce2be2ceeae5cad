"""Cumulative counters, one dataclass per owner (each written only by its owner), summed into the
one flat dict that server_info's "stats" and the Prometheus metrics read."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass

import orjson
import torch


class Counters:
    """Base of the counter sets: plain int fields, snapshot and restore (the warmup leaves none)."""

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def restore(self, snapshot: dict[str, int]) -> None:
        for name, value in snapshot.items():
            setattr(self, name, value)


@dataclass
class StepCounters(Counters):
    """The scheduler's: requests taken, tokens computed, steps run, and where the time went: the
    wall time from a step's launch to the next one's (what the step cost while the scheduler was
    busy), summed over steps of decodes only, steps whose prompt chunks are all suffixes over
    compressed prefixes (questions on compressed documents), and the other steps with a prompt chunk."""
    requests: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_steps: int = 0  # steps with a decode (beside prompt chunks or not)
    prefill_steps: int = 0  # steps with a prompt chunk
    suffix_steps: int = 0  # of those, the ones whose prompt chunks all follow a compressed prefix
    decode_only_step_ms: int = 0
    suffix_step_ms: int = 0
    prefill_step_ms: int = 0


@dataclass
class CacheCounters(Counters):
    """The cache's: prompt tokens the radix cache supplied (dense and compressed), requests that
    found dense pages there, and prompt tokens prefilled again because the cache had dropped them."""
    cached_tokens: int = 0
    dense_prefix_hits: int = 0
    reprefilled_tokens: int = 0


@dataclass
class CompressionCounters(Counters):
    """The compressed tier's: what was compressed, and what later requests reused compressed."""
    compressed_requests: int = 0  # requests whose own prompt was compressed at its prefill
    compressed_tokens: int = 0  # tokens compressed, all segments
    compressions: int = 0  # segments compressed
    tail_compressions: int = 0  # segments made of a finished request's long dense tail (a chat's growth)
    compressed_prefix_hits: int = 0  # requests that matched a compressed prefix
    compressed_tokens_reused: int = 0  # tokens of those prefixes
    exact_copy_hits: int = 0  # of those, prefills over every chunk that read the prefix's exact copies
    dense_copy_prefills: int = 0  # of those, prefills over the copies loaded into dense pages (cold's kernel)
    gpu_value_loads: int = 0  # segments whose values were copied onto the GPU (lent pages)
    gpu_value_drops: int = 0  # segments whose GPU values were given back (read from the host since)
    parked_tokens: int = 0  # tokens of segments whose GPU state moved to the host tier (extreme pressure)
    unparked_tokens: int = 0  # tokens of parked segments a request matched, copied back to the GPU


@dataclass
class DemotionCounters(Counters):
    """The demoter's: dense spans of the cache turned compressed instead of dropped, and the
    documents that left the dense GPU tier by each reason of the cost rule (tier_choice.py)."""
    demotions: int = 0
    demoted_tokens: int = 0
    demotions_abandoned: int = 0  # finished while requests kept using the span dense
    to_host_reload_cheaper: int = 0  # under pressure, to the host tier: a reload costs less than compressed
    compressed_no_room: int = 0  # under pressure, compressed: no host tier, or it could not take it
    compressed_sparse_cheaper: int = 0  # under pressure, compressed: costs less than a reload
    compressed_decode_pays: int = 0  # no pressure, compressed: its decode rows save more than it costs
    rows_made_sparse: int = 0  # running requests switched from reading a document dense to sparse


class StepClock:
    """The step clock split by what a step held, for benchmarks that must say where serving time
    went: a step's label is its kind (StepCounters' three) plus "+decode" when decodes ran beside
    its prompt chunks and "+compress" when a prompt compressed at its prefill in it. Per label:
    steps, wall ms (as StepCounters books it), prompt tokens and decode rows, so a mixed step's
    cost per prompt token reads apart from a pure prefill's, and on a GPU device_ms (see
    DeviceStepTimer). Not in the flat stats: its labels are open-ended, Prometheus's names are not."""

    FIELDS = ("steps", "ms", "prompt_tokens", "decode_rows", "device_ms")

    def __init__(self):
        self.shapes: dict[str, dict[str, int]] = {}

    def _shape(self, label: str) -> dict[str, int]:
        return self.shapes.setdefault(label, dict.fromkeys(self.FIELDS, 0))

    def book(self, label: str, ms: int, prompt_tokens: int, decode_rows: int) -> None:
        shape = self._shape(label)
        for name, value in zip(self.FIELDS, (1, ms, prompt_tokens, decode_rows)):
            shape[name] += value

    def book_device(self, label: str, ms: int) -> None:
        self._shape(label)["device_ms"] += ms

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {label: dict(shape) for label, shape in sorted(self.shapes.items())}

    def restore(self, snapshot: dict[str, dict[str, int]]) -> None:
        self.shapes = {label: dict(shape) for label, shape in snapshot.items()}


class StepLog:
    """--step-log: one JSON line per step, written when the next step launches (so with its wall
    time): its launch in seconds since the scheduler started, label (see StepClock), wall ms, its
    prompt chunks as [start, tokens, over a compressed prefix], decode rows, the queues at launch
    (waiting, prefilling, decoding), the pool's pages (unused, lent for GPU values, reserved,
    cached and unlocked) and with ShadowKV the GPU value loads and drops so far and the decode rows
    over compressed chunks with how many of them read every value from HBM. The aggregate
    clock says how much time a kind of step took; this says when, e.g. which steps held a cold
    document's first token back (benchmarks/step_timeline.py summarises it). Line-buffered."""

    def __init__(self, path: str | None):
        self.file = open(path, "a", buffering=1) if path else None
        self.started = time.perf_counter()

    def write(self, launched: float, label: str, ms: int, detail: dict) -> None:
        if self.file is not None:
            line = {"t": round(launched - self.started, 4), "label": label, "ms": ms, **detail}
            self.file.write(orjson.dumps(line).decode() + "\n")


class DeviceStepTimer:
    """CUDA events around each launched step, read once the device has run them (polled, never
    waited for): the time on the compute stream from the step's first kernel to its last, booked
    to the step's label as the clock's device_ms. The wall clock books a step from its launch to
    the next launch, so an eager step that fills CUDA's launch queue (a prompt chunk and 32 layers
    of compression) also carries the steps before it; this does not. Off a GPU it does nothing."""

    def __init__(self, clock: StepClock, device: torch.device):
        self.clock, self.enabled = clock, device.type == "cuda"
        self.pending: deque[tuple[str, torch.cuda.Event, torch.cuda.Event]] = deque()

    def start(self) -> "torch.cuda.Event | None":
        if not self.enabled:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, label: str, started: "torch.cuda.Event | None") -> None:
        if started is not None:
            ended = torch.cuda.Event(enable_timing=True)
            ended.record()
            self.pending.append((label, started, ended))
        self.collect()

    def collect(self) -> None:
        """Book the steps the device has finished, in launch order."""
        while self.pending and self.pending[0][2].query():
            label, started, ended = self.pending.popleft()
            self.clock.book_device(label, round(started.elapsed_time(ended)))

    def forget(self) -> None:
        """Drop what is pending unbooked (the warmup's steps)."""
        self.pending.clear()


def clock_since(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """What the steps between two StepClock snapshots (as_dict, server_info's steps.clock) added,
    per label that changed."""
    return {label: {f: n - before.get(label, {}).get(f, 0) for f, n in shape.items()}
            for label, shape in after.items() if shape != before.get(label)}


def merged(*owners: Counters) -> dict[str, int]:
    """One flat dict of every owner's counters (names are unique across owners)."""
    out: dict[str, int] = {}
    for owner in owners:
        out.update(owner.as_dict())
    return out
