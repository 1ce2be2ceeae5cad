"""Whether capturing a CUDA graph while serving can hide behind work already queued on the device.

A graph captured while serving (a new chunk width's decode or suffix graph) records the step's
kernels on the host; the device could go on with the steps queued before it meanwhile. This
measures where the host waits: an Engine (random-weight Llama-3.1-8B shape by default) compresses
a 16K document, then for each graph it would capture next (its width's decode variants at the
largest batch, suffix steps of one request), ~0.4 s of bf16 GEMMs is queued and the graph captured
with the phases timed on the host: stand-in inputs, the backend's plan, recording (capture_begin to
the end of the forward), capture_end (the end of recording and instantiation), and whether the
queued GEMMs had finished by the end of each. The same capture with the device idle gives its own
cost.

    python benchmarks/capture_wait.py --tokenizer-path .tok    # on a GPU machine

Writes --out (default $OUT/capture_wait.json or benchmarks/results/capture_wait.json) and prints a
table. Needs CUDA (graphs are captured only there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUEUED_GEMMS = 250  # 8192^3 bf16 GEMMs: ~0.4 s on an H100


def timed_capture(graphs, key, busy) -> dict:
    """Capture `key` after queueing `busy` work; host seconds at each phase's end and whether the
    queued work was done by then (not asked while recording: a capturing stream refuses queries)."""
    marks = []
    done = torch.cuda.Event()

    def mark(phase: str):
        recording = torch.cuda.is_current_stream_capturing()
        marks.append((phase, round(time.perf_counter() - start, 4), None if recording else done.query()))

    originals = {}

    def wrap(owner, name, phase):
        fn = originals[(owner, name)] = getattr(owner, name)

        def inner(*args, **kwargs):
            out = fn(*args, **kwargs)
            mark(phase)
            return out
        setattr(owner, name, inner)

    wrap(graphs, "_stand_in", "stand-in inputs")
    wrap(graphs.backend, "begin_graph_step", "plan")
    wrap(torch.cuda.CUDAGraph, "capture_begin", "capture_begin")
    wrap(graphs, "_forward", "forward recorded")
    wrap(torch.cuda.CUDAGraph, "capture_end", "capture_end")
    try:
        torch.cuda.synchronize()
        busy()
        done.record()
        start = time.perf_counter()
        graphs.graphs.pop(key, None)
        graphs._capture([key])
        mark("end")
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)
    torch.cuda.synchronize()
    began = time.perf_counter()
    graphs.graphs.pop(key, None)
    graphs._capture([key])
    return {"key": str(key), "phases": marks, "idle_capture_s": round(time.perf_counter() - began, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="random:llama-3.1-8b")
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--document-tokens", type=int, default=16500)
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "capture_wait.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("capture_wait.py needs CUDA: graphs are captured only on a GPU")
    from sglang_shadowkv import Engine
    from sglang_shadowkv.sampling_params import SamplingParams

    with Engine(model_path=args.model_path, tokenizer_path=args.tokenizer_path, attention="shadowkv",
                shadowkv_compress_policy="eager") as engine:
        sched = engine.scheduler
        vocab = sched.vocab_size
        ids = [1000 + (i * 7919) % (vocab - 2000) for i in range(args.document_tokens)]
        sched.add_request("doc", ids, SamplingParams(max_new_tokens=2))
        while sched.has_work:
            sched.step()
        graphs = sched.runner.graphs
        # the document's decode width: the widest plain sparse variant (the warmup's document is shorter)
        width = max(v for _, v in graphs.graphs if isinstance(v, int))
        keys = [(graphs.max_bs, width), (graphs.max_bs, ("long_window", width)),
                (("suffix", 1, 64), ("suffix", width)), (("suffix", 1, 128), ("suffix", width))]
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

        def busy():
            for _ in range(QUEUED_GEMMS):
                a @ a

        torch.cuda.synchronize()
        t = time.perf_counter()
        busy()
        torch.cuda.synchronize()
        queued_s = time.perf_counter() - t
        rows = [timed_capture(graphs, key, busy) for key in keys]
    report = {"device": torch.cuda.get_device_name(), "model_path": args.model_path,
              "queued_work_s": round(queued_s, 4), "captures": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"device: {report['device']}; queued work alone {queued_s:.3f} s")
    for row in rows:
        phases = " ".join(f"{p} {s:.3f}{'' if d is None else (' done' if d else '')}" for p, s, d in row["phases"])
        print(f"{row['key']}: {phases}; idle capture {row['idle_capture_s']:.3f} s")


if __name__ == "__main__":
    main()
