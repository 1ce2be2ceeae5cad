"""ShadowKV settings against exact attention, layer by layer, without generating: the data the
defaults were chosen from (rank energy, budget cap and top-p, scoring rule).

Per prompt one dense prefill; per setting the prompt is compressed as the server would and every
layer's last queries are compared with exact attention (Engine.shadowkv_report): the ranks the
setting gives, the output error of its low-rank keys alone, and per scoring rule (mean landmark,
bounds, oracle) the recall of attention mass, the chunks chosen and the output error; plus the GPU
saving against a full KV cache. Prompts: two chat prompts over stdlib prose (fidelity.py's), the
memo of memo_retrieval.py and a multi-needle NIAH haystack, about 6K tokens each.

    python benchmarks/selection_sweep.py                 # both sweeps, CPU (~40 min on 2 cores)
    python benchmarks/selection_sweep.py --sweeps rank --prompts memo

Writes JSON (per sweep, setting and prompt the report's summary); prints one line per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import random

from sglang_shadowkv import Engine
from sglang_shadowkv.testing.haystack import grid_needles, niah_prompt
from sglang_shadowkv.testing.prompts import chat_prompt, memo_prompts

SWEEPS = {  # setting name -> ShadowKVConfig fields over the defaults
    "rank": {"rank 30 (old default)": {"rank": 30}, **{f"energy {e}": {"rank_energy": e, "rank_cap": 192}
                                                         for e in (0.95, 0.98, 0.99, 0.995, 0.999, 0.9999)},
             "energy 0.9999, cap 160 (default)": {}, "rank 192 (exact keys)": {"rank": 192}},
    "budget": {**{f"top-p {p}, cap {m}": {"top_p": p, "max_budget": m} for p in (0.8, 0.9, 0.95, 0.98, 0.99)
                  for m in (256, 512)},
               **{f"fixed {k} chunks": {"budget": 1e-4, "min_budget_chunks": k} for k in (32, 64, 128, 256)}},
}


def prompts(engine: Engine) -> dict[str, list[int]]:
    memo, _ = memo_prompts(engine, 5000, 12, 0)
    needle, hidden = grid_needles("multikv", 0.5, random.Random(0))
    return {"prose 0": chat_prompt(engine, 6000, 0), "prose 1": chat_prompt(engine, 6000, 1),
            "memo": memo[3], "multikv": niah_prompt(engine, 6144, 0.5, needle, hidden)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--attention-backend", default=None, help="torch | triton | flashinfer (default: best)")
    ap.add_argument("--sweeps", nargs="+", default=list(SWEEPS), choices=list(SWEEPS))
    ap.add_argument("--prompts", nargs="+", default=None, help="names of prompts() to run (default: all)")
    ap.add_argument("--queries", type=int, default=16, help="last prompt queries per prompt")
    ap.add_argument("--out", default="benchmarks/results/selection_sweep.json")
    args = ap.parse_args()
    engine = Engine(model_path=args.model_path, attention_backend=args.attention_backend, max_total_tokens=16384, chunked_prefill_size=2048,
                    max_running_requests=2, dtype="float32")
    result = {"model": engine.get_server_info()["model_path"], "queries": args.queries, "sweeps": {}}
    for name, ids in prompts(engine).items():
        if args.prompts and name not in args.prompts:
            continue
        for sweep in args.sweeps:
            reps = engine.shadowkv_report(input_ids=ids, num_queries=args.queries, settings=list(SWEEPS[sweep].values()))
            for setting, rep in zip(SWEEPS[sweep], reps):
                row = {"prompt_tokens": len(ids), "ranks": rep["ranks"], **rep["summary"]}
                result["sweeps"].setdefault(sweep, {}).setdefault(setting, {})[name] = row
                rules = row["rules"]
                print(f"{name:>8} | {setting:<34} rank {row['rank']:5.1f} (max {max(rep['ranks']):3d}) "
                      f"low-rank err {row['lowrank_output_error']:.4f} saving {row['gpu_saving_vs_full']:.2f}x | "
                      + " | ".join(f"{r} recall {v['recall']:.4f} (min head {v['min_head_recall']:.3f}) "
                                   f"chunks {v['chunks_mean']:5.1f} err {v['output_error']:.4f}"
                                   for r, v in rules.items()), flush=True)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    engine.shutdown()


if __name__ == "__main__":
    main()
