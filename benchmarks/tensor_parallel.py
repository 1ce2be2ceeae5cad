"""Tensor parallelism checked where it runs: TP=N gives TP=1's tokens, in both attention modes,
with CUDA graphs (their all-reduces inside them), overlap scheduling and mixed steps as served.

Per mode, one Engine at TP=1 and one at each --tp size over the same random weights, greedy,
float32 (a different summation order of the all-reduce moves bfloat16 logits enough to flip
near-ties on random weights): a document and questions over it (with ShadowKV the document is
compressed at its prefill and the questions hit it: sparse suffix prefill, sparse decode), then
a batch of independent prompts decoding together (CUDA-graph decode steps). Reports token
agreement, each rank's start-up time and memory, and the counters that show the paths taken.

    python benchmarks/tensor_parallel.py --tokenizer-path .tok --out tp_check.json      # (GPU, 2+ GPUs)
    python benchmarks/tensor_parallel.py --model-path tests_tiny_llama --device cpu     # gloo, slow
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import multiprocessing
import os
import random
import signal
import threading
import time

from sglang_shadowkv import Engine

SHADOWKV = dict(shadowkv_min_context=1024, shadowkv_compress_policy="eager")


def prompts(vocab: int, doc_tokens: int, seed: int = 0) -> tuple[list[int], list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    doc = [rng.randrange(10, vocab - 10) for _ in range(doc_tokens)]
    questions = [[rng.randrange(10, vocab - 10) for _ in range(40)] for _ in range(4)]
    batch = [[rng.randrange(10, vocab - 10) for _ in range(rng.randrange(50, 400))] for _ in range(12)]
    return doc, questions, batch


def dump_if_stuck(seconds: float) -> threading.Timer:
    """After `seconds`, every process's stacks into the log, then exit: the ranks first (SIGUSR1,
    their faulthandler), then this one's. A thread, not a signal, so that no handler another
    library installs can swallow it."""
    def dump():
        for child in multiprocessing.active_children():
            os.kill(child.pid, signal.SIGUSR1)
        time.sleep(3)
        print(f"stuck for {seconds:g} s: every thread's stack follows", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    timer = threading.Timer(seconds, dump)
    timer.daemon = True
    timer.start()
    return timer


def run(tp: int, mode: str, args) -> dict:
    flags = dict(model_path=args.model_path, tokenizer_path=args.tokenizer_path, dtype=args.dtype,
                 attention_backend=args.attention_backend, device=args.device, tp_size=tp, attention=mode,
                 max_running_requests=16, check_integrity=True, log_level=args.log_level,
                 watchdog_timeout=args.watchdog_timeout, **(SHADOWKV if mode == "shadowkv" else {}))
    started = time.perf_counter()
    print(f"{mode} TP={tp}: starting", flush=True)
    stuck = dump_if_stuck(args.stuck_after)
    with Engine(**flags) as engine:
        startup = time.perf_counter() - started
        print(f"{mode} TP={tp}: started in {startup:.1f} s", flush=True)
        doc, questions, batch = prompts(len(engine.tokenizer), args.doc_tokens)
        greedy = {"max_new_tokens": args.new_tokens, "temperature": 0}
        outs = [engine.generate(input_ids=doc + questions[0], sampling_params=greedy)["output_ids"]]
        outs += [o["output_ids"] for o in engine.generate(input_ids=[doc + q for q in questions[1:]],
                                                          sampling_params=greedy)]
        outs += [o["output_ids"] for o in engine.generate(input_ids=batch, sampling_params=greedy)]
        info = engine.get_server_info()
        stats = info["stats"]
        stuck.cancel()
        return {"tp_size": tp, "mode": mode, "startup_s": round(startup, 1), "ranks": info["ranks"],
                "outputs": outs, "graph_replays": (info["steps"]["cuda_graph"] or {}).get("replays", 0),
                "eager_steps": info["steps"]["eager_steps"], "device": info["device"],
                **{k: stats.get(k, 0) for k in ("compressions", "compressed_prefix_hits", "decode_steps")}}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    return same / max(1, sum(max(len(p), len(q)) for p, q in zip(a, b)))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="random:llama-3.2-1b")
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--attention-backend", default="triton", help="triton runs float32 (FlashInfer does not)")
    ap.add_argument("--tp", type=int, nargs="+", default=[2], help="TP sizes compared with TP=1")
    ap.add_argument("--modes", nargs="+", default=["full", "shadowkv"], choices=["full", "shadowkv"])
    ap.add_argument("--doc-tokens", type=int, default=3000)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--out", default=None, help="write the report here as JSON")
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--watchdog-timeout", type=float, default=120.0,
                    help="a step that takes longer ends the run with every rank's stacks in the log")
    ap.add_argument("--stuck-after", type=float, default=600.0,
                    help="an engine's start and requests that take longer end the run with every process's stacks")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1: where a run hangs
    report = {"runs": []}
    for mode in args.modes:
        runs = {tp: run(tp, mode, args) for tp in [*args.tp, 1]}  # the parallel runs first: they are the news
        for tp in args.tp:
            other, base = runs[tp], runs[1]
            other["agreement_with_tp1"] = agreement(base["outputs"], other["outputs"])
            other["identical_to_tp1"] = other["outputs"] == base["outputs"]
            print(f"{mode:9s} TP={tp}: tokens identical to TP=1: {other['identical_to_tp1']} "
                  f"(agreement {other['agreement_with_tp1']:.3f}); start {base['startup_s']} s at TP=1, "
                  f"{other['startup_s']} s at TP={tp}; graph replays {other['graph_replays']}, "
                  f"compressions {other['compressions']}, hits {other['compressed_prefix_hits']}", flush=True)
        report["runs"] += list(runs.values())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
