"""One decode step of a fixed set of requests as a CUDA graph, replayed with new input tokens.

Eager decode launches a few hundred small kernels per step (ShadowKV adds scores, top-k, the chunk
cache, key rebuild, value gather and sparse attention to every layer), so at small batches the
CPU, not the GPU, sets the pace. The graph holds the whole step: embedding, every layer
(projections, RoPE, KV write, the attention backend including ShadowKV's two-stream fetch), the
final norm and lm_head. Fixed at capture: the requests, their positions, pool slots and the
backend's step plan; a replay feeds new tokens at the same positions. That is what a throughput
measurement needs (benchmarks/bench_throughput.py); the scheduler, whose batches change every
step, still runs eagerly. The graph reads the plan made at capture, so no other step may run on
the runner between replays (an eager step re-plans).
"""

from __future__ import annotations

import torch

from .model_runner import ModelRunner, StepItem


class DecodeGraph:
    def __init__(self, runner: ModelRunner, items: list[StepItem], warmup: int = 2):
        if runner.device.type != "cuda":
            raise RuntimeError("CUDA graphs need a CUDA device")
        if any(len(it.token_ids) != 1 for it in items):
            raise ValueError("a decode graph takes one new token per request")
        self.batch = runner.build_batch(items)
        runner.backend.begin_step(self.batch)
        side = torch.cuda.Stream(runner.device)
        side.wait_stream(torch.cuda.current_stream(runner.device))
        with torch.cuda.stream(side):  # compile kernels and settle allocations outside the capture
            for _ in range(warmup):
                runner.model(self.batch, runner.backend)
        torch.cuda.current_stream(runner.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = runner.model(self.batch, runner.backend)
        self._plan = dict(vars(runner.backend))  # keeps the captured plan's tensors alive

    def replay(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, vocab] of the step with these new tokens [B] (a view, overwritten next replay)."""
        self.batch.input_ids.copy_(input_ids)
        self.graph.replay()
        return self.logits
