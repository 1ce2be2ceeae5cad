"""Summarise a server's `--step-log` file: where serving time went, and when.

    python benchmarks/step_timeline.py STEPS.jsonl [--bucket 5] [--slow-ms 700] [--gap 3]

The log is split into runs at idle gaps (no step for `--gap` seconds: a client's warmup request,
a benchmark's next workload). Per run: its span, then per `--bucket` seconds the steps, their wall
time, the cold prompt tokens (chunks not over a compressed prefix), the suffix tokens (over one),
the decode rows, the most prompts admitted at once and, with ShadowKV, the GPU value loads and
drops in that bucket, the decode rows over compressed chunks (sparse) and those reading every value
from HBM, and the most pages lent for GPU values; then every step slower than `--slow-ms` (a compile, a capture, a stall).
`--json` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path


def read_steps(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def split_runs(steps: list[dict], gap_s: float) -> list[list[dict]]:
    """Consecutive steps with no idle gap of gap_s seconds between one's end and the next's launch."""
    runs: list[list[dict]] = []
    for step in steps:
        if runs and step["t"] - (runs[-1][-1]["t"] + runs[-1][-1]["ms"] / 1000) < gap_s:
            runs[-1].append(step)
        else:
            runs.append([step])
    return runs


def summarise_run(run: list[dict], bucket_s: float, slow_ms: int) -> dict:
    start = run[0]["t"]
    buckets: dict[int, Counter] = {}
    last_values = run[0].get("gpu_values")
    for step in run:
        b = buckets.setdefault(int((step["t"] - start) // bucket_s), Counter())
        b["steps"] += 1
        b["ms"] += step["ms"]
        for _, tokens, compressed in step["chunks"]:
            b["suffix_tokens" if compressed else "cold_tokens"] += tokens
        b["decode_rows"] += step["decode_rows"]
        b["most_prefilling"] = max(b["most_prefilling"], step["prefilling"])
        if step.get("gpu_values") is not None:
            b["value_loads"] += step["gpu_values"][0] - last_values[0]
            b["value_drops"] += step["gpu_values"][1] - last_values[1]
            last_values = step["gpu_values"]
        if step.get("sparse_rows") is not None:
            b["sparse_rows"] += step["sparse_rows"][0]
            b["hbm_rows"] += step["sparse_rows"][1]
            b["most_lent"] = max(b["most_lent"], step["pages"]["lent"])
    return {"start_s": round(start, 2), "span_s": round(run[-1]["t"] + run[-1]["ms"] / 1000 - start, 2),
            "steps": len(run),
            "buckets": [{"from_s": k * bucket_s, **v} for k, v in sorted(buckets.items())],
            "slow_steps": [{"at_s": round(s["t"] - start, 2), "label": s["label"], "ms": s["ms"]}
                           for s in run if s["ms"] > slow_ms]}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="a --step-log file")
    ap.add_argument("--bucket", type=float, default=5.0, help="seconds per row of the table")
    ap.add_argument("--slow-ms", type=int, default=700, help="list the steps slower than this")
    ap.add_argument("--gap", type=float, default=3.0, help="idle seconds that end a run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    runs = [summarise_run(r, args.bucket, args.slow_ms) for r in split_runs(read_steps(args.log), args.gap)]
    if args.json:
        print(json.dumps(runs, indent=1))
        return runs
    cols = ("steps", "ms", "cold_tokens", "suffix_tokens", "decode_rows", "most_prefilling", "value_loads",
            "value_drops", "sparse_rows", "hbm_rows", "most_lent")
    for i, run in enumerate(runs):
        print(f"run {i}: from {run['start_s']} s, {run['span_s']} s, {run['steps']} steps")
        print("  from_s " + " ".join(f"{c:>12s}" for c in cols))
        for b in run["buckets"]:
            print(f"  {b['from_s']:6.0f} " + " ".join(f"{b.get(c, 0):>12d}" for c in cols))
        for s in run["slow_steps"]:
            print(f"  slow: {s['at_s']} s {s['label']} {s['ms']} ms")
    return runs


if __name__ == "__main__":
    main()
