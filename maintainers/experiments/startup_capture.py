"""Where a server's start goes: phases from its log, CUDA-graph capture, and the Triton kernels it
compiles, on a fresh kernel cache (a new machine, a user's first start) and again on the cache
that start left (every later start).

Per attention mode, `launch_server` is started at default flags (plus --server-flag), twice, with
TRITON_CACHE_DIR pointing at a folder of this run: first empty, then as the first start left it.
Recorded per start: seconds until /health answers; the log's timestamped lines as seconds since
launch (model load, memory plan and host pinning, warmup, capture); server_info's graph figures
(graphs, capture seconds, graph memory). After the fresh start the Triton cache says what was
compiled: per kernel, its variants (one per specialization) and the seconds between its first and
last compiled stage (each stage's file is written as it is produced: a lower bound of its compile
time, Python's front end not counted).

    python maintainers/experiments/startup_capture.py --tokenizer-path DIR     # on a GPU machine
    python maintainers/experiments/startup_capture.py --model-path random:smollm2-135m --modes shadowkv  # CPU check

Writes --out (default startup_capture.json in $OUT, else in the current folder) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the repository's packages
from benchmarks.sglang_client_bench import compiled_kernels  # noqa: E402
from sglang_shadowkv.testing.live_server import LiveServer  # noqa: E402

LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (.*)$")


def log_timeline(log: str, launched: float) -> list[tuple[float, str]]:
    """(seconds since launch, message) of every timestamped log line (the server logs local time)."""
    out = []
    for line in log.splitlines():
        m = LOG_TIME.match(line)
        if m:
            stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((round(stamp - launched, 2), m.group(2)[:240]))
    return out


def start_once(mode: str, args, cache_dir: Path) -> dict:
    flags = ["--attention", mode, "--log-level", "info", *(["--model-path", args.model_path] if args.model_path else []),
             *(["--tokenizer-path", args.tokenizer_path] if args.tokenizer_path else []), *args.server_flag]
    launched = time.time()
    server = LiveServer(*flags, env={"TRITON_CACHE_DIR": str(cache_dir)})
    try:
        server.wait_healthy(args.startup_timeout)
        ready = round(time.time() - launched, 1)
        info = httpx.get(server.url + "/get_server_info", timeout=60).json()
        graphs = info["steps"]["cuda_graph"] or {}
        return {"startup_s": ready, "graphs": graphs.get("graphs", 0),
                "capture_seconds": graphs.get("capture_seconds", 0.0),
                "graph_bytes": graphs.get("graph_bytes", 0), "device": info["device"],
                "log": log_timeline(server.output(), launched)}
    finally:
        server.kill_group()


def run_mode(mode: str, args, workdir: Path) -> dict:
    cache_dir = workdir / f"triton-cache-{mode}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)
    fresh = start_once(mode, args, cache_dir)
    fresh["kernels"] = compiled_kernels(cache_dir)
    warm = start_once(mode, args, cache_dir)
    shutil.rmtree(cache_dir, ignore_errors=True)
    return {"fresh": fresh, "warm": warm}


def print_table(report: dict) -> None:
    print(f"{'mode':9s} {'cache':6s} {'start s':>8s} {'graphs':>6s} {'capture s':>9s} {'graph GiB':>9s}")
    for mode, starts in report["modes"].items():
        for name in ("fresh", "warm"):
            s = starts[name]
            print(f"{mode:9s} {name:6s} {s['startup_s']:8.1f} {s['graphs']:6d} {s['capture_seconds']:9.1f} "
                  f"{s['graph_bytes'] / 2**30:9.2f}")
        kernels = starts["fresh"]["kernels"]
        total = sum(k["variants"] for k in kernels.values())
        print(f"  fresh start compiled {total} Triton variants of {len(kernels)} kernels; the costliest:")
        for name, k in list(kernels.items())[:8]:
            print(f"    {name:40s} {k['variants']:3d} variants {k['seconds']:6.1f} s")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default="random:llama-3.1-8b", help="'' for the embedded model")
    parser.add_argument("--tokenizer-path", help="tokenizer folder (needed by random:* shapes without the embedded model)")
    parser.add_argument("--modes", nargs="+", default=["full", "shadowkv"], choices=["full", "shadowkv"])
    parser.add_argument("--server-flag", action="append", default=[], help="extra server flag (repeatable)")
    parser.add_argument("--startup-timeout", type=float, default=420)
    default_out = Path(os.environ.get("OUT", ".")) / "startup_capture.json"
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"model_path": args.model_path, "server_flags": args.server_flag, "modes": {}}
    for mode in args.modes:
        report["modes"][mode] = run_mode(mode, args, args.out.parent)
        args.out.write_text(json.dumps(report, indent=1))  # what finished survives a later timeout
    print_table(report)
    return report


if __name__ == "__main__":
    main()
