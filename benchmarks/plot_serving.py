"""Draw docs/serving.png from the committed reports of benchmarks/sglang_client_bench.py: output
throughput, TTFT p50 and TTFT p99 of full attention and ShadowKV against how many documents or chat
sessions the GPU must hold.

Each report holds, per attention mode, the workloads SGLang's serving client ran against one server
(`generated-shared-prefix`: `--gsp-num-groups` documents or chat sessions, documents cold). A point
is one (device, workload, mode) taken from the latest reports that ran it: a report's date is its
`date` field, else the time of the last commit that touched its file (else the file's mtime), and
the newest date wins. Where several reports share that date (repeat runs), the point is their
median and the error bar spans them. A run with a server flag beyond the benchmark's own (an A/B
variant such as --disable-mixed-step-overlap) is left out; --step-log is not a variant. So is a
workload that only one mode ran at default flags: it has nothing to be set against.

    python benchmarks/plot_serving.py                          # benchmarks/results/sglang_bench_*.json
    python benchmarks/plot_serving.py R1.json R2.json --out /tmp/serving.png

Prints the points it drew and the reports each came from.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REPORTS = "benchmarks/results/sglang_bench_*.json"
MODES = {"full": "full attention", "shadowkv": "ShadowKV"}
# flags sglang_client_bench.py itself passes (with their values): not an A/B variant of the defaults
BENCH_FLAGS = {"--attention", "--tokenizer-path", "--served-model-name", "--log-level", "--model-path"}


def report_date(path: Path, report: dict) -> str:
    """ISO date (or time) of a report: its own field, else its file's last commit, else its mtime."""
    if report.get("date"):
        return str(report["date"])
    try:
        done = subprocess.run(["git", "log", "-1", "--format=%cI", "--", path.name], cwd=path.parent,
                              capture_output=True, text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc).isoformat(timespec="seconds")


def variant_flags(server_flags: list[str]) -> list[str]:
    """The server flags beyond the benchmark's own: what makes a run an A/B variant."""
    out, i = [], 0
    while i < len(server_flags):
        flag = server_flags[i]
        if flag in BENCH_FLAGS:
            i += 2
            continue
        if flag.startswith("--step-log"):
            i += 1 if "=" in flag else 2
            continue
        out.append(flag)
        i += 1
    return out


def client_arg(args: list[str], name: str) -> int | None:
    return int(args[args.index(name) + 1]) if name in args else None


def short_device(device: str) -> str:
    for name in ("H200", "H100", "A100", "L40S"):
        if name in device:
            return name
    return device


def read_runs(paths: list[Path]) -> list[dict]:
    """Every completed workload of every mode run at default flags, one dict each."""
    import json

    runs = []
    for path in paths:
        report = json.loads(path.read_text())
        date = report_date(path, report)
        for mode, record in report.get("modes", {}).items():
            if mode not in MODES or variant_flags(record.get("server_flags", [])):
                continue
            for name, w in record.get("workloads", {}).items():
                if not w.get("completed") or not w.get("output_throughput"):
                    continue
                args = w["client_args"]
                runs.append({"device": short_device(record.get("device", "?")), "workload": name, "mode": mode,
                             "holds": client_arg(args, "--gsp-num-groups"), "turns": client_arg(args, "--gsp-num-turns"),
                             "doc_tokens": client_arg(args, "--gsp-system-prompt-len"), "date": date,
                             "file": path.name, "output_throughput": w["output_throughput"],
                             "ttft_p50_s": w["median_ttft_ms"] / 1e3, "ttft_p99_s": w["p99_ttft_ms"] / 1e3})
    return runs


def points(paths: list[Path]) -> list[dict]:
    """Per (device, workload, mode): the median of the latest date's runs, with their range."""
    groups: dict[tuple, list[dict]] = {}
    for run in read_runs(paths):
        groups.setdefault((run["device"], run["workload"], run["mode"]), []).append(run)
    out = []
    for (device, workload, mode), runs in sorted(groups.items()):
        latest = max(r["date"] for r in runs)
        newest = [r for r in runs if r["date"] == latest]
        chosen, seen = [], set()
        for r in newest:
            key = (r["output_throughput"], r["ttft_p50_s"], r["ttft_p99_s"])
            if key not in seen:  # a report may carry another's run as its baseline: one run, counted once
                seen.add(key)
                chosen.append(r)
        point = {"device": device, "workload": workload, "mode": mode, "holds": chosen[0]["holds"],
                 "turns": chosen[0]["turns"], "doc_tokens": chosen[0]["doc_tokens"], "date": latest[:10],
                 "files": sorted({r["file"] for r in newest}), "runs": len(chosen)}
        for metric in ("output_throughput", "ttft_p50_s", "ttft_p99_s"):
            values = [r[metric] for r in chosen]
            point[metric] = statistics.median(values)
            point[metric + "_range"] = (min(values), max(values))
        out.append(point)
    return out


def workload_label(p: dict) -> str:
    size = f"{p['doc_tokens'] // 1024}K" if p["doc_tokens"] else "?"
    return f"{p['holds']} chats\nx {size}" if p["turns"] else f"{p['holds']} docs\nx {size}"


def draw(pts: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("output_throughput", "output tokens/s (higher is better)"),
              ("ttft_p50_s", "TTFT p50, s (lower is better)"), ("ttft_p99_s", "TTFT p99, s (lower is better)")]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    colors = {"full": "#4c72b0", "shadowkv": "#dd8452"}
    markers = ["o", "s", "^", "D"]
    devices = sorted({p["device"] for p in pts})
    # one evenly spaced slot per size, in order (4 and 8 documents would overlap on a linear axis)
    sizes = sorted({p["holds"] for p in pts})
    slot = {holds: i for i, holds in enumerate(sizes)}
    labels = {p["holds"]: workload_label(p) for p in pts}
    shift = {"full": -0.06, "shadowkv": 0.06}  # side by side, so their error bars do not hide each other
    for ax, (metric, title) in zip(axes, panels):
        for d, device in enumerate(devices):
            for mode, label in MODES.items():
                line = sorted((p for p in pts if p["device"] == device and p["mode"] == mode), key=lambda p: p["holds"])
                if not line:
                    continue
                xs = [slot[p["holds"]] + shift[mode] for p in line]
                ys = [p[metric] for p in line]
                err = [[y - p[metric + "_range"][0] for y, p in zip(ys, line)],
                       [p[metric + "_range"][1] - y for y, p in zip(ys, line)]]
                dates = sorted({p["date"] for p in line})
                ax.errorbar(xs, ys, yerr=err, color=colors[mode], marker=markers[d % len(markers)], linestyle=":",
                            capsize=3, label=f"{label}, {device} ({', '.join(dates)})")
        ax.set_xticks(range(len(sizes)), [labels[h] for h in sizes], fontsize=8)
        ax.set_xlabel("documents or chat sessions the GPU must hold")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle("SGLang's serving client against both attention modes (random-weight Llama-3.1-8B shape, "
                 "bf16, default flags, documents cold)", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="*", type=Path, help=f"sglang_client_bench.py reports (default: {DEFAULT_REPORTS})")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "serving.png", help="PNG to write (default: docs/serving.png)")
    args = ap.parse_args(argv)
    paths = args.reports or sorted(ROOT.glob(DEFAULT_REPORTS))
    if not paths:
        ap.error(f"no reports: none match {DEFAULT_REPORTS}")
    pts = points(paths)
    in_both = set.intersection(*({(p["device"], p["workload"]) for p in pts if p["mode"] == m} for m in MODES))
    pts = [p for p in pts if (p["device"], p["workload"]) in in_both]
    if not pts:
        ap.error("no workload completed at default flags in both modes in the reports")
    draw(pts, args.out)
    for p in pts:
        print(f"{p['device']:5s} {p['workload']:10s} {p['mode']:8s} holds {p['holds']:3d}  "
              f"{p['output_throughput']:7.1f} tok/s  TTFT p50 {p['ttft_p50_s']:6.2f} s  p99 {p['ttft_p99_s']:6.2f} s  "
              f"{p['date']}  {p['runs']} run(s) in {', '.join(p['files'])}")
    print(f"wrote {args.out}")
    return pts


if __name__ == "__main__":
    main()
