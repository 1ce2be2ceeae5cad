"""ShadowKV against full attention on the same model and prompts (CPU by default).

1. Greedy continuations of long prompts (chat-formatted stdlib documentation + a question) through
   two engines, attention="full" and attention="shadowkv": token agreement per prompt, free-running
   (each engine follows its own tokens) and teacher-forced (ShadowKV predicts each next token after
   full attention's continuation so far).
2. The selection report (Engine.shadowkv_report, shadowkv/selection_report.py) of the first
   --report-prompts prompts: per layer and KV head the recall of exact attention mass held by the
   attended set (selected chunks + outliers + window) under each scoring rule (mean landmark, the
   paper's; per-channel key bounds, Quest's; the oracle's true chunk mass), the chunks each
   chooses, the attention-output error of the low-rank keys alone and of the whole approximation,
   on the KV the full model computed (so errors do not compound across layers).

    python benchmarks/fidelity.py                      # 10 prompts of 6K tokens, 32 new tokens, defaults
    python benchmarks/fidelity.py --shadowkv-rank 64   # any Engine shadowkv_* keyword as a flag

Prints tables; writes JSON to --out (default benchmarks/results/fidelity.json).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from tqdm import tqdm

from sglang_shadowkv import Engine
from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.shadowkv.config import ShadowKVConfig
from sglang_shadowkv.shadowkv.selection_report import format_report, summarize
from sglang_shadowkv.testing.engine_flags import add_engine_flags, engine_kwargs, engine_overrides
from sglang_shadowkv.testing.prompts import chat_prompt


def forced_predictions(engine: Engine, ids: list[int], forced: list[int], sampling: dict) -> list[int]:
    """Greedy token at every position when the continuation so far is `forced` (teacher forcing):
    after each step the sampled token is recorded and replaced by the forced one, so one early
    near-tie flip does not make the rest of the continuation disagree."""
    sched = engine.scheduler
    req = sched.add_request("forced", ids, SamplingParams.from_dict(sampling))
    preds: list[int] = []
    overlap, sched.overlap = sched.overlap, False  # each step's input must be the forced token
    try:
        while not req.finished:
            for update in sched.step():
                if update.req is req and update.new_ids:
                    preds.append(update.new_ids[0])
                    req.output_ids[-1] = forced[len(preds) - 1]
                    if not req.finished:  # the next step's input, on the device
                        sched.runner.next_input[req.pool_row] = req.output_ids[-1]
    finally:
        sched.overlap = overlap
    return preds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--prompt-tokens", type=int, default=6000, help="document tokens per prompt")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--report-prompts", type=int, default=3, help="prompts of the selection report")
    ap.add_argument("--report-queries", type=int, default=16, help="last prompt queries per report prompt")
    ap.add_argument("--dtype", default="float32",
                    help="float32 (default; bf16 rounding alone flips near-tie greedy tokens) or bfloat16")
    ap.add_argument("--out", default="benchmarks/results/fidelity.json")
    args = ap.parse_args()
    overrides = engine_overrides(args)
    common = engine_kwargs(args, 16384, max_running_requests=4)
    full = Engine(attention="full", **common)
    shadow = Engine(attention="shadowkv", shadowkv_max_requests=2, **common, **overrides)
    cfg = shadow.scheduler.runner.shadowkv_config
    sampling = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    rows = []
    for seed in tqdm(range(args.num_prompts), desc="prompts"):
        ids = chat_prompt(full, args.prompt_tokens, seed)
        t0 = time.perf_counter()
        want = full.generate(input_ids=ids, sampling_params=sampling)
        t1 = time.perf_counter()
        got = shadow.generate(input_ids=ids, sampling_params=sampling)
        t2 = time.perf_counter()
        shadow.flush_cache()
        forced = forced_predictions(shadow, ids, want["output_ids"], sampling)
        full.flush_cache()
        shadow.flush_cache()
        a, b = got["output_ids"], want["output_ids"]
        first_diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        info = got["meta_info"]["shadowkv"]
        rows.append({"seed": seed, "prompt_tokens": len(ids), "agreement": sum(x == y for x, y in zip(a, b)) / len(b),
                     "forced_agreement": sum(x == y for x, y in zip(forced, b)) / len(b),
                     "first_divergence": first_diff, "compressed_tokens": info["compressed_tokens"],
                     "mean_rank": sum(info["ranks"]) / len(info["ranks"]), "ranks": info["ranks"],
                     "mean_chunks": info["budget"]["mean_chunks"], "budget": info["budget"],
                     "chunk_cache_hit_rate": info["chunk_cache_hit_rate"],
                     "gpu_saving_vs_full": info["gpu_saving_vs_full"], "seconds_full": t1 - t0,
                     "seconds_shadowkv": t2 - t1, "full_text": want["text"], "shadowkv_text": got["text"]})
    settings = [{k.removeprefix("shadowkv_"): v for k, v in overrides.items()
                 if k.removeprefix("shadowkv_") in ShadowKVConfig.__dataclass_fields__}]
    reports = [full.shadowkv_report(input_ids=chat_prompt(full, args.prompt_tokens, seed), settings=settings,
                                    num_queries=args.report_queries)[0]
               for seed in tqdm(range(min(args.report_prompts, args.num_prompts)), desc="selection reports")]
    report = summarize(reports)
    agreement = sum(r["agreement"] for r in rows) / len(rows)
    forced_agreement = sum(r["forced_agreement"] for r in rows) / len(rows)
    result = {"model": full.get_server_info()["model_path"], "device": str(full.scheduler.runner.device),
              "config": {k: v for k, v in vars(cfg).items()}, "engine_overrides": overrides,
              "new_tokens": args.new_tokens, "token_agreement": agreement, "forced_token_agreement": forced_agreement,
              "gpu_saving_vs_full": sum(r["gpu_saving_vs_full"] for r in rows) / len(rows),
              "mean_chunks": sum(r["mean_chunks"] for r in rows) / len(rows), "prompts": rows,
              "attention_rel_error_per_layer": report["decode_output_error_per_layer"],
              "selection_report": report, "selection_report_prompts": reports}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("\n" + format_report(report))
    print(f"\n{'seed':>4} {'tokens':>6} {'compressed':>10} {'rank':>5} {'chunks':>6} {'agree':>6} {'forced':>6} "
          f"{'1st diff':>8} {'hit':>5} {'GPU save':>8}")
    for r in rows:
        print(f"{r['seed']:4d} {r['prompt_tokens']:6d} {r['compressed_tokens']:10d} {r['mean_rank']:5.0f} "
              f"{r['mean_chunks']:6.1f} {r['agreement']:6.2f} {r['forced_agreement']:6.2f} {r['first_divergence']:8d} "
              f"{r['chunk_cache_hit_rate']:5.2f} {r['gpu_saving_vs_full']:8.2f}")
    print(f"token agreement over {len(rows)} prompts x {args.new_tokens} tokens: free-running {agreement:.3f}, "
          f"teacher-forced {forced_agreement:.3f}")


if __name__ == "__main__":
    main()
