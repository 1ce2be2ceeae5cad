"""N requests over one long document: the first prefills and compresses it, the rest reuse it.

Reports time to first token of request 1 against requests 2..N (ShadowKV, and full attention with
its dense radix cache beside it), and GPU bytes of N requests sharing the compressed document
against N dense copies. Prints a table; writes JSON.

    python benchmarks/bench_prefix_reuse.py                       # CPU, embedded model, 6K document
    python benchmarks/bench_prefix_reuse.py --model-path random:llama-3.1-8b --doc-tokens 65536 \\
        --tokenizer-path TOKENIZER_DIR --attention-backend flashinfer   # the H100
"""

from __future__ import annotations

import argparse
import json
import os
import time

from sglang_shadowkv import Engine
from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.testing.corpus import document


def run(engine: Engine, doc: list[int], questions: list[list[int]], new_tokens: int) -> list[dict]:
    rows = []
    for i, question in enumerate(questions):
        t0 = time.perf_counter()
        out = engine.generate(input_ids=doc + question, sampling_params={
            "max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True})
        meta = out["meta_info"]
        rows.append({"request": i + 1, "ttft_s": meta["ttft"], "latency_s": time.perf_counter() - t0,
                     "prompt_tokens": meta["prompt_tokens"], "cached_tokens": meta["cached_tokens"],
                     "shadowkv": meta["shadowkv"]})
    return rows


def shared_gpu_bytes(engine: Engine, doc: list[int], questions: list[list[int]]) -> dict:
    """N requests decoding at once over the cached document: GPU bytes held, against N dense copies."""
    sched = engine.scheduler
    sampling = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    reqs = [sched.add_request(f"mem-{i}", doc + q, sampling) for i, q in enumerate(questions)]
    while not all(r.output_ids for r in reqs):  # every request past its prefill
        sched.step()
    info = engine.get_server_info()["shadowkv"]
    per_request = info["per_request"].values()
    pools = info["pools"]
    private = sum(r["dense_kv_bytes"] + r["gpu_scratch_bytes"] for r in per_request)
    result = {"requests": len(reqs), "segment_gpu_bytes": pools["segment_gpu_bytes"],
              "segment_host_bytes": pools["segment_host_bytes"], "private_gpu_bytes": private,
              "shared_total_gpu_bytes": pools["segment_gpu_bytes"] + private,
              "dense_copies_gpu_bytes": sum(r["full_kv_bytes"] for r in per_request)}
    result["saving"] = result["dense_copies_gpu_bytes"] / result["shared_total_gpu_bytes"]
    while sched.has_work:
        sched.step()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2; or random:llama-3.1-8b")
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--doc-tokens", type=int, default=6000)
    ap.add_argument("--num-requests", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--shadowkv-min-context", type=int, default=2048)
    ap.add_argument("--shadowkv-host-tokens", type=int, default=None, help="compressed pool capacity")
    ap.add_argument("--skip-full", action="store_true", help="do not run the full-attention baseline")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "prefix_reuse.json"))
    args = ap.parse_args()
    common = dict(model_path=args.model_path, tokenizer_path=args.tokenizer_path, dtype=args.dtype,
                  attention_backend=args.attention_backend, chunked_prefill_size=8192,
                  max_running_requests=args.num_requests,
                  max_total_tokens=(args.num_requests + 2) * (args.doc_tokens + 256))
    shadow = Engine(attention="shadowkv", shadowkv_compress_policy="eager",  # the document fits dense: force it
                    shadowkv_min_context=args.shadowkv_min_context,
                    shadowkv_host_tokens=args.shadowkv_host_tokens,
                    shadowkv_max_requests=args.num_requests, **common)
    runner = shadow.scheduler.runner
    doc = document(shadow.tokenizer, args.doc_tokens, seed=0)
    questions = [shadow.tokenizer.encode(f"\nQuestion {i}: what is this text about? Answer:",
                                         add_special_tokens=False) for i in range(args.num_requests)]
    result = {"device": str(runner.device), "model": runner.loaded.model_path, "doc_tokens": len(doc),
              "attention_backend": runner.backend_name}
    if runner.device.type == "cuda":
        import torch
        result["device"] = torch.cuda.get_device_name()
    warm = document(shadow.tokenizer, args.shadowkv_min_context + 512, seed=1)
    run(shadow, warm, questions[:2], 2)  # compile kernels and warm allocators: not timed
    shadow.flush_cache()
    result["shadowkv"] = run(shadow, doc, questions, args.new_tokens)
    shadow.flush_cache()
    run(shadow, doc, questions[:1], 1)  # the document cached again for the memory measurement
    result["memory"] = shared_gpu_bytes(shadow, doc, questions)
    result["counters"] = {k: shadow.get_server_info()["stats"][k] for k in (
        "compressions", "compressed_prefix_hits", "compressed_tokens_reused", "prefill_tokens")}
    shadow.shutdown()
    del shadow
    if not args.skip_full:
        full = Engine(attention="full", **common)
        run(full, warm, questions[:2], 2)
        full.flush_cache()
        result["full"] = run(full, doc, questions, args.new_tokens)
        full.shutdown()
    for method in ("shadowkv", "full"):
        rows = result.get(method)
        if rows:
            later = [r["ttft_s"] for r in rows[1:]]
            result[f"{method}_ttft_speedup"] = rows[0]["ttft_s"] / (sum(later) / len(later))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\ndevice: {result['device']}, model {result['model']}, document {len(doc)} tokens")
    print(f"{'method':>9} {'request':>7} {'ttft s':>8} {'cached':>7} {'compressed':>10}")
    for method in ("shadowkv", "full"):
        for r in result.get(method, []):
            print(f"{method:>9} {r['request']:7d} {r['ttft_s']:8.3f} {r['cached_tokens']:7d} "
                  f"{r['shadowkv']['compressed_tokens']:10d}")
        if f"{method}_ttft_speedup" in result:
            print(f"{method:>9}: request 1 / mean of requests 2..N = {result[f'{method}_ttft_speedup']:.1f}x")
    mem = result["memory"]
    print(f"GPU bytes, {mem['requests']} requests sharing the compressed document: "
          f"{mem['shared_total_gpu_bytes'] / 2**20:.1f} MiB vs {mem['dense_copies_gpu_bytes'] / 2**20:.1f} MiB "
          f"for dense copies ({mem['saving']:.1f}x); host {mem['segment_host_bytes'] / 2**20:.1f} MiB")
    print(f"counters: {result['counters']}")


if __name__ == "__main__":
    main()
