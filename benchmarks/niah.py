"""Needle In A Haystack through the engine: ShadowKV against full attention on the same prompts.

A grid of context lengths x needle depths x needle forms (sglang_shadowkv/testing/haystack.py:
synthetic filler, random needle values, no download). Every prompt runs through one Engine per
method (the same engine build, the cache flushed between prompts so each prompt stands alone); a
prompt counts as retrieved when the needle's value appears in the greedy answer.

    python benchmarks/niah.py                    # CPU, embedded SmolLM2: 1K..7.5K x 5 depths x 3 forms
    python benchmarks/niah.py --methods full shadowkv snapkv --lengths 2048 4096 --shadowkv-rank 64

Writes JSON (top-level "accuracy": method -> overall accuracy, beside every cell) and a heatmap
PNG (length x depth, one panel per method); prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from tqdm import tqdm

from sglang_shadowkv import Engine
from sglang_shadowkv.server_args import ATTENTION_MODES
from sglang_shadowkv.testing.engine_flags import add_engine_flags, engine_kwargs, engine_overrides
from sglang_shadowkv.testing.haystack import FORMS, grid_needles, niah_prompt


def build_prompts(engine: Engine, args) -> list[dict]:
    cases = []
    for form in args.forms:
        for length in args.lengths:
            for depth in args.depths:
                for sample in range(args.samples):
                    rng = random.Random(f"{args.seed}/{form}/{length}/{depth}/{sample}")
                    needle, hidden = grid_needles(form, depth, rng)
                    cases.append({"form": form, "length": length, "depth": depth, "sample": sample,
                                  "needle": needle, "ids": niah_prompt(engine, length, depth, needle, hidden)})
    return cases


def run_method(method: str, cases: list[dict], common: dict, args, progress) -> list[dict]:
    engine = Engine(attention=method, **common)
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
    rows = []
    try:
        for case in cases:
            t0 = time.perf_counter()
            out = engine.generate(input_ids=case["ids"], sampling_params=sampling)
            engine.flush_cache()
            skv = out["meta_info"].get("shadowkv") or {}
            rows.append({"method": method, "form": case["form"], "length": case["length"],
                         "depth": case["depth"], "sample": case["sample"],
                         "prompt_tokens": len(case["ids"]), "needle": case["needle"].value,
                         "answer": out["text"], "correct": case["needle"].found_in(out["text"]),
                         "compressed_tokens": skv.get("compressed_tokens", 0),
                         "seconds": time.perf_counter() - t0})
            progress.update(1)
            progress.set_postfix(method=method, acc=f"{sum(r['correct'] for r in rows) / len(rows):.2f}")
    finally:
        engine.shutdown()
    return rows


def cell_accuracy(rows: list[dict], method: str, length: int, depth: float) -> float:
    hits = [r["correct"] for r in rows if r["method"] == method and r["length"] == length and r["depth"] == depth]
    return sum(hits) / len(hits)


def plot(rows: list[dict], methods: list[str], lengths: list[int], depths: list[float], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(methods), figsize=(4.2 * len(methods), 3.6), squeeze=False)
    for ax, method in zip(axes[0], methods):
        grid = [[cell_accuracy(rows, method, n, d) for n in lengths] for d in depths]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("needle depth")
        acc = sum(r["correct"] for r in rows if r["method"] == method) / sum(r["method"] == method for r in rows)
        ax.set_title(f"{method}: {acc:.1%}")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=8)
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8, label="retrieval accuracy")
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap)
    ap.add_argument("--methods", nargs="+", default=["full", "shadowkv"], choices=ATTENTION_MODES)
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 6144, 7680])
    ap.add_argument("--depths", nargs="+", type=float, default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    ap.add_argument("--samples", type=int, default=1, help="prompts per (form, length, depth) cell")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="benchmarks/results/niah.json")
    ap.add_argument("--plot", default=None, help="heatmap PNG (default: --out with .png)")
    args = ap.parse_args()
    overrides = engine_overrides(args)
    # compress every prompt of the grid: the threshold sits below its shortest length
    overrides.setdefault("shadowkv_min_context", min(args.lengths) // 2)
    common = {**engine_kwargs(args, 2 * max(args.lengths) + 1024), **overrides}
    probe = Engine(attention="full", **common)  # tokenizer and chat template for the prompts
    cases = build_prompts(probe, args)
    info = probe.get_server_info()
    probe.shutdown()
    rows = []
    with tqdm(total=len(cases) * len(args.methods), desc="NIAH prompts") as progress:
        for method in args.methods:
            rows += run_method(method, cases, common, args, progress)
    accuracy = {m: sum(r["correct"] for r in rows if r["method"] == m) / len(cases) for m in args.methods}
    result = {"model": info["model_path"], "device": info["device"], "dtype": info["dtype"],
              "accuracy": accuracy, "engine_overrides": overrides, "lengths": args.lengths,
              "depths": args.depths, "forms": args.forms, "samples": args.samples,
              "grid": {m: {str(n): {str(d): cell_accuracy(rows, m, n, d) for d in args.depths}
                           for n in args.lengths} for m in args.methods},
              "by_form": {m: {f: sum(r["correct"] for r in rows if r["method"] == m and r["form"] == f)
                              / sum(r["method"] == m and r["form"] == f for r in rows) for f in args.forms}
                          for m in args.methods},
              "rows": rows}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(rows, args.methods, args.lengths, args.depths, args.plot or os.path.splitext(args.out)[0] + ".png")
    print(f"\nNIAH accuracy ({info['model_path']}, {info['device']}), rows: length, columns: depth")
    for m in args.methods:
        print(f"{m:>12} " + " ".join(f"{d:>6.0%}" for d in args.depths) + "   by form: " +
              " ".join(f"{f} {a:.2f}" for f, a in result["by_form"][m].items()))
        for n in args.lengths:
            print(f"{n:>12} " + " ".join(f"{cell_accuracy(rows, m, n, d):6.2f}" for d in args.depths))
    print("overall: " + ", ".join(f"{m} {a:.3f}" for m, a in accuracy.items()))


if __name__ == "__main__":
    main()
