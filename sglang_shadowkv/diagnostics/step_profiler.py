"""torch.profiler over scheduler steps, started and stopped through the server (SGLang's
/start_profile and /stop_profile), so a step is profiled the way users run it: the real scheduler
loop, its batches, CUDA graphs and overlap included.

What it writes to output_dir: a Chrome trace (open in Perfetto) and a text table of the ops that
took the most device time; the summary that /stop_profile returns lists those ops as data, and
the ops that took the most host time.
"""

from __future__ import annotations

import json
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

TOP_OPS = 25


class StepProfiler:
    def __init__(self):
        self.prof: profile | None = None
        self.output_dir = ""
        self.steps_left: int | None = None
        self.steps = 0
        self.started = 0.0
        self.last: dict | None = None  # the last finished profile's summary

    @property
    def active(self) -> bool:
        return self.prof is not None

    def start(self, output_dir: str | None = None, num_steps: int | None = None) -> str:
        """Raises ValueError naming a bad argument or when a profile is already running."""
        if self.active:
            raise ValueError("a profile is already running: stop it first (/stop_profile)")
        if num_steps is not None and (isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1):
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
        if output_dir is not None and not isinstance(output_dir, str):
            raise ValueError(f"output_dir must be a string, got {output_dir!r}")
        self.output_dir = output_dir or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")
        try:
            os.makedirs(self.output_dir, exist_ok=True)
        except OSError as err:
            raise ValueError(f"output_dir {self.output_dir!r} cannot be made: {err}") from None
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(activities=activities)
        self.prof.start()
        self.steps_left, self.steps, self.started = num_steps, 0, time.perf_counter()
        return f"Start profiling ({num_steps or 'until /stop_profile'} steps) to {self.output_dir}."

    def after_step(self) -> None:
        if not self.active:
            return
        self.steps += 1
        if self.steps_left is not None:
            self.steps_left -= 1
            if self.steps_left == 0:
                self.stop()

    def stop(self) -> dict:
        """End the running profile (if any) and return the last profile's summary."""
        if self.active:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds = time.perf_counter() - self.started
            self.prof.stop()
            prof, self.prof = self.prof, None
            stamp = time.strftime("%Y%m%d-%H%M%S")
            trace = os.path.join(self.output_dir, f"profile-{stamp}.trace.json")
            prof.export_chrome_trace(trace)
            self.last = summarize(prof, self.steps, seconds, trace)
            with open(os.path.join(self.output_dir, f"profile-{stamp}.txt"), "w") as f:
                f.write(json.dumps({k: v for k, v in self.last.items() if k != "top_ops"}) + "\n")
                f.write(prof.key_averages().table(sort_by=self.last["sorted_by"], row_limit=TOP_OPS))
        if self.last is None:
            raise ValueError("no profile has run: start one with /start_profile")
        return self.last


def summarize(prof: profile, steps: int, seconds: float, trace: str) -> dict:
    """Per op: calls and self time on the device and the host, the top TOP_OPS by device time
    (host time without a GPU), and the totals per step."""
    events = prof.key_averages()
    on_device = torch.cuda.is_available()
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    ops = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:TOP_OPS]
    per_step = max(steps, 1)
    return {
        "steps": steps, "seconds": round(seconds, 4), "ms_per_step": round(1e3 * seconds / per_step, 3),
        "device_ms_per_step": round(sum(e.self_device_time_total for e in events) / 1e3 / per_step, 3)
        if on_device else None,
        "host_ms_per_step": round(sum(e.self_cpu_time_total for e in events) / 1e3 / per_step, 3),
        "sorted_by": key, "trace": trace,
        "top_ops": [_op(e) for e in ops],
        # by host time too: a host wait (a sync, cudaMalloc/cudaFree) costs no device time
        "top_host_ops": [_op(e) for e in sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPS]],
    }


def _op(event) -> dict:
    return {"name": event.key, "calls": event.count, "self_device_ms": round(event.self_device_time_total / 1e3, 3),
            "self_host_ms": round(event.self_cpu_time_total / 1e3, 3)}
