"""SGLang's own serving benchmark client (`sglang.benchmark.serving`, generated-shared-prefix
workloads, chat backend) against this server, each attention mode at default flags, documents
arriving cold as users send them (their first prefill and compression inside the clock).

    python benchmarks/sglang_client_bench.py --client PATH/TO/sglang_bench.py --tokenizer TOK \\
        --model-path random:llama-3.1-8b --modes full shadowkv --out benchmarks/results/sglang_bench_h100.json

Per mode: one server (its own process group), every workload in order with /flush_cache between,
the client's result line and the server's counters after each. The JSON names the device, the
date, the client's arguments per workload, and ShadowKV's ratios to full attention where both ran.
The client's per-request output files live in a temporary folder, removed at the end; a
`--profile-at` window's traces go beside --out.
`--client` is a script running `sglang.benchmark.serving.cli_main` (SGLang's own `python -m
sglang.bench_serving` works the same way where SGLang is installed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages
from sglang_shadowkv.scheduler.counters import clock_since  # noqa: E402
from sglang_shadowkv.testing.live_server import LiveServer  # noqa: E402

# name: generated-shared-prefix workload (the cases; 'chat' turns hold one concurrency slot each)
WORKLOADS = {
    "shared_32k": dict(groups=4, per_group=8, doc=32768, output=64, concurrency=8),
    "shared_16k": dict(groups=8, per_group=4, doc=16384, output=64, concurrency=8),
    # more documents than full attention's pool holds, each asked 4 times in shuffled order (at 2 a
    # document, re-prefilling caps any cache's gain near 1.3x: 40 first prefills of 80 requests)
    "many_16k": dict(groups=40, per_group=4, doc=16384, output=32, concurrency=16),
    "chat_16k": dict(groups=48, per_group=1, turns=4, doc=16384, output=32, concurrency=48),
    # tensor parallelism's cases: 8 documents asked 8 questions each; a cold 32K prompt's time to
    # first token (the client's warm-up request caches the first of the three); 8 long decodes at 32K
    "docs_32k_8q": dict(groups=8, per_group=8, doc=32768, output=64, concurrency=16),
    "cold_32k": dict(groups=3, per_group=1, doc=32768, output=8, concurrency=1),
    "decode_32k_x8": dict(groups=8, per_group=1, doc=32768, output=256, concurrency=8),
    "smoke_8k": dict(groups=2, per_group=2, doc=8192, output=16, concurrency=4),  # a model family's GPU check
    # decode-bound (the cache hierarchy's case): 8 documents x 4 questions, long answers, all in flight
    "decode_64k_x32": dict(groups=8, per_group=4, doc=65536, output=1024, concurrency=32),
    # decode-bound chat: 48 sessions over their own 32K documents, 4 turns of 256-token answers
    "chat_32k_256": dict(groups=48, per_group=1, turns=4, doc=32768, output=256, concurrency=48),
    "tiny": dict(groups=2, per_group=2, turns=2, doc=600, output=8, concurrency=2),  # seconds on a CPU
}
QUESTION_TOKENS = 64
METRICS = ("duration", "completed", "output_throughput", "total_throughput", "median_ttft_ms", "p90_ttft_ms",
           "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms",
           "total_input_tokens", "total_output_tokens")
COUNTERS = ("prefill_tokens", "cached_tokens", "decode_steps", "prefill_steps", "suffix_steps", "decode_only_step_ms",
            "suffix_step_ms", "prefill_step_ms", "dense_prefix_hits", "reprefilled_tokens", "compressions",
            "compressed_requests", "compressed_prefix_hits", "demotions", "demoted_tokens", "gpu_value_loads",
            "gpu_value_drops", "to_host_reload_cheaper", "compressed_no_room", "compressed_sparse_cheaper",
            "compressed_decode_pays", "rows_made_sparse", "host_hit_tokens", "host_loaded_bytes", "host_load_ms",
            "host_stored_bytes", "host_evicted_tokens")


def client_args(workload: dict, url: str, model: str, tokenizer: str, output_file: str) -> list[str]:
    args = ["--base-url", url, "--model", model, "--backend", "sglang-oai-chat", "--tokenizer", tokenizer,
            "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(workload["groups"]),
            "--gsp-prompts-per-group", str(workload["per_group"]), "--gsp-system-prompt-len", str(workload["doc"]),
            "--gsp-question-len", str(QUESTION_TOKENS), "--gsp-output-len", str(workload["output"]),
            "--max-concurrency", str(workload["concurrency"]), "--output-file", output_file, "--disable-tqdm",
            "--seed", "1", "--output-details"]
    return args + (["--gsp-num-turns", str(workload["turns"])] if "turns" in workload else [])


def server_counters(url: str) -> dict:
    info = httpx.get(url + "/get_server_info", timeout=60).json()
    out = {k: info["stats"].get(k) for k in COUNTERS if k in info["stats"]}
    graphs = info["steps"]["cuda_graph"] or {}
    out.update(eager_steps=info["steps"]["eager_steps"], graph_replays=graphs.get("replays", 0),
               graphs=graphs.get("graphs", 0), graph_capture_seconds=graphs.get("capture_seconds", 0.0),
               step_clock=info["steps"].get("clock", {}), graph_captures=graphs.get("capture_log", []),
               graph_replays_by_variant=graphs.get("replays_by_variant", {}),
               **{f"allocator_{k}": v for k, v in info.get("allocator", {}).items()})
    if info.get("shadowkv"):
        out.update({k: info["shadowkv"][k] for k in COUNTERS if k in info["shadowkv"]})
        out["chunk_cache"] = info["shadowkv"]["chunk_cache"]
        out["tier_rates"] = info["shadowkv"].get("tier_rates")  # what the tier rule read as the workload ended
    return out


def counter_delta(before: dict, after: dict) -> dict:
    """What a workload added to the server's counters: numbers subtracted, the step clock per
    label, graph replays per variant, the graphs captured during it (a log that only grows);
    anything else as it ends."""
    out = {}
    for k, v in after.items():
        if isinstance(v, (int, float)):
            out[k] = round(v - before[k], 2)
        elif k == "graph_replays_by_variant":
            out[k] = {variant: n - before[k].get(variant, 0) for variant, n in v.items() if n != before[k].get(variant, 0)}
        elif k == "step_clock":
            out[k] = clock_since(before[k], v)
        elif k == "graph_captures":
            out[k] = v[len(before[k]):]
        else:
            out[k] = v
    return out


def profile_window(url: str, at: float, steps: int, workdir: Path) -> threading.Thread:
    """Start the server's profiler `at` seconds into a workload, for `steps` scheduler steps (a
    diagnosis: the profiler slows the steps it records, so such a run's numbers do not count)."""
    def start():
        time.sleep(at)
        httpx.post(url + "/start_profile", json={"num_steps": steps, "output_dir": str(workdir)}, timeout=60)

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    return thread


def run_mode(mode: str, args, workdir: Path, profile_dir: Path, saved=lambda result: None) -> dict:
    flags = ["--attention", mode, "--tokenizer-path", args.tokenizer, "--served-model-name", "bench",
             "--log-level", "info", *(["--model-path", args.model_path] if args.model_path else []), *args.server_flag]
    started = time.perf_counter()
    result = {"server_flags": flags, "workloads": {}}
    # fresh unless --triton-cache names one: compiles while serving show
    triton_cache = Path(args.triton_cache or tempfile.mkdtemp(prefix="sglang-shadowkv-triton-"))
    server = LiveServer(*flags, env={"TRITON_CACHE_DIR": str(triton_cache)})
    try:
        server.wait_healthy(args.startup_timeout)
        info = httpx.get(server.url + "/get_server_info", timeout=60).json()
        result.update(startup_s=round(time.perf_counter() - started, 1), device=device_name(info["device"]),
                      capacity=info["capacity"], graphs=info["steps"]["cuda_graph"], ranks=info.get("ranks"))
        for name in args.workloads:
            httpx.post(server.url + "/flush_cache", timeout=60)
            before, kernels = server_counters(server.url), triton_variants(triton_cache)
            out_file = workdir / f"{mode}_{name}.jsonl"
            cargs = client_args(WORKLOADS[name], server.url, "bench", args.tokenizer, str(out_file))
            t0 = time.perf_counter()
            profiler = profile_window(server.url, args.profile_at, args.profile_steps, profile_dir) if args.profile_at else None
            try:
                proc = subprocess.run([sys.executable, args.client, *cargs], capture_output=True, text=True,
                                      timeout=args.workload_timeout)
            except subprocess.TimeoutExpired as err:
                proc = subprocess.CompletedProcess(err.cmd, -9, str(err.stdout or ""), f"timed out after {err.timeout} s")
            profile = None
            if profiler is not None:
                profiler.join()
                profile = httpx.post(server.url + "/stop_profile", timeout=300).json()
            after = server_counters(server.url)
            line = out_file.read_text().strip().splitlines()[-1] if out_file.exists() else "{}"
            client = json.loads(line)
            result["workloads"][name] = {
                "client_args": cargs, "returncode": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1),
                **{k: client.get(k) for k in METRICS}, **request_details(client),
                "server": counter_delta(before, after),
                "triton_compiles": new_variants(kernels, triton_variants(triton_cache)),
                "client_tail": proc.stdout[-1500:] if proc.returncode else "",
                "client_stderr_tail": proc.stderr[-1500:] if proc.returncode else "",
                **({"profile": profile} if profile is not None else {})}
            print(f"{mode:9s} {name:11s} " + summary_line(result["workloads"][name]), flush=True)
            saved(result)  # each workload on disk as it ends: a run cut short keeps what it measured
    finally:  # saved also when the server died mid-run: its log says why
        log = server.output()
        result["server_log_tail"] = log[-8000:]
        if args.server_log:
            Path(args.out).with_name(f"{Path(args.out).stem}_{mode}_server.log").write_text(log)
        saved(result)
        server.kill_group()
        if not args.triton_cache:
            shutil.rmtree(triton_cache, ignore_errors=True)
    return result


def ttir_signature(files: list[Path]) -> str:
    """A variant's signature as Triton specialized it (argument types and divisibility attributes,
    from its .ttir): what tells two variants of one kernel apart."""
    for f in files:
        if f.suffix == ".ttir":
            for line in f.read_text().splitlines():
                if "tt.func public" in line:
                    return re.sub(r" ?loc\([^()]*(\([^()]*\))?\)", "", line.strip())[:4000]
    return ""


def compiled_kernels(cache_dir: Path) -> dict[str, dict]:
    """Per Triton kernel name in a cache folder: its variants, their compile seconds (first to last
    stage file of each variant) and, for a kernel of several variants, their signatures."""
    kernels: dict[str, dict] = defaultdict(lambda: {"variants": 0, "seconds": 0.0, "signatures": []})
    for entry in cache_dir.iterdir() if cache_dir.is_dir() else []:
        files = [f for f in entry.iterdir() if f.is_file()]
        binaries = [f for f in files if f.suffix in (".cubin", ".hsaco")]
        if not binaries:
            continue  # launcher stubs and other cached helpers
        stamps = [f.stat().st_mtime for f in files if not f.name.startswith("__grp__")]
        record = kernels[binaries[0].stem]
        record["variants"] += 1
        record["seconds"] = round(record["seconds"] + max(stamps) - min(stamps), 2)
        record["signatures"].append(ttir_signature(files))
    for record in kernels.values():
        if record["variants"] < 2:
            record.pop("signatures")
    return dict(sorted(kernels.items(), key=lambda kv: -kv[1]["seconds"]))


def triton_variants(cache: Path) -> dict[str, int]:
    """Compiled variants per Triton kernel in the server's cache folder."""
    return {name: kernel["variants"] for name, kernel in compiled_kernels(cache).items()}


def new_variants(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Variants compiled between two snapshots, per kernel: a request that waited for the compiler
    (the server's warmup should have compiled every variant serving needs)."""
    return {name: n - before.get(name, 0) for name, n in after.items() if n != before.get(name, 0)}


def request_details(client: dict) -> dict:
    """Each request's TTFT (seconds, in the client's order) and prompt tokens, from the client's
    --output-details: which requests make a tail (a chat's first turns, or its later ones)."""
    if "ttfts" not in client:
        return {}
    return {"ttfts_s": [round(t, 3) for t in client["ttfts"]], "prompt_lens": client.get("input_lens")}


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device.startswith("cuda") else device


def summary_line(w: dict) -> str:
    if not w.get("completed"):
        return f"rc={w['returncode']} (no result) {w['client_stderr_tail'][-300:]}"
    return (f"out {w['output_throughput']:.1f} tok/s  TTFT p50/p90/p99 {w['median_ttft_ms'] / 1e3:.2f}/"
            f"{w['p90_ttft_ms'] / 1e3:.2f}/{w['p99_ttft_ms'] / 1e3:.2f} s  ITL p50/p99 {w['median_itl_ms']:.1f}/"
            f"{w['p99_itl_ms']:.1f} ms  prefilled {w['server'].get('prefill_tokens')}")


def ratios(report: dict) -> dict:
    """ShadowKV / full per workload: throughput (higher is better), TTFT and ITL (lower is better)."""
    full, skv = report["modes"].get("full"), report["modes"].get("shadowkv")
    if not full or not skv:
        return {}
    out = {}
    for name, s in skv["workloads"].items():
        f = full["workloads"].get(name)
        if not f or not f.get("completed") or not s.get("completed"):
            continue
        out[name] = {"output_throughput": s["output_throughput"] / f["output_throughput"],
                     **{k: s[k] / f[k] for k in ("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_itl_ms",
                                                 "p99_itl_ms") if f[k]}}
    return out


def merge_reports(parts: list[dict]) -> dict:
    """One report from parts run in separate device calls: a mode's workloads are gathered from every
    part that ran it (the rest of a mode's record, its server start, comes from its first part)."""
    report = {"modes": {}}
    for part in parts:
        report.update({k: v for k, v in part.items() if k not in ("modes", "shadowkv_vs_full")})
        for mode, record in part["modes"].items():
            merged = report["modes"].setdefault(mode, {**record, "workloads": {}})
            merged["workloads"].update(record["workloads"])
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--client", help="script that runs sglang.benchmark.serving's cli_main (required to run)")
    parser.add_argument("--tokenizer", help="tokenizer folder, the client's and the server's (required to run)")
    parser.add_argument("--model-path", default="random:llama-3.1-8b", help="'' for the embedded model")
    parser.add_argument("--modes", nargs="+", default=["full", "shadowkv"], choices=["full", "shadowkv"])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--server-flag", action="append", default=[], help="extra server flag (repeatable)")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--workload-timeout", type=float, default=300)
    parser.add_argument("--server-log", action="store_true",
                        help="also write each server's whole log beside --out (OUT_STEM_MODE_server.log)")
    parser.add_argument("--profile-at", type=float, help="diagnosis: profile the server from this many seconds "
                        "into each workload (its numbers then do not count); the summary goes into the report")
    parser.add_argument("--profile-steps", type=int, default=30, help="steps a --profile-at window records")
    parser.add_argument("--triton-cache", help="Triton's cache folder, kept (servers started one after another "
                        "compile what they share once; default: a fresh one per server, removed after it)")
    parser.add_argument("--merge", nargs="+", help="merge these reports (one per mode) instead of running")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.merge:
        report = merge_reports([json.loads(Path(part).read_text()) for part in args.merge])
    else:
        if not args.client or not args.tokenizer:
            parser.error("--client and --tokenizer are required unless --merge is given")
        out_dir = Path(args.out).parent
        out_dir.mkdir(parents=True, exist_ok=True)
        report = {"client": "sglang.benchmark.serving (sglang 0.5.23), backend sglang-oai-chat, "
                            "dataset generated-shared-prefix, documents cold",
                  "model_path": args.model_path, "date": datetime.date.today().isoformat(), "modes": {}}
        workdir = Path(tempfile.mkdtemp(prefix="sglang-client-bench-"))  # the client's per-request files
        try:
            for mode in args.modes:
                def saved(result, mode=mode):
                    report["modes"][mode] = result
                    Path(args.out).write_text(json.dumps(report, indent=1))
                report["modes"][mode] = run_mode(mode, args, workdir, out_dir, saved)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    report["shadowkv_vs_full"] = ratios(report)
    Path(args.out).write_text(json.dumps(report, indent=1))
    for name, r in report["shadowkv_vs_full"].items():
        print(f"shadowkv/full {name:11s} " + "  ".join(f"{k} {v:.2f}" for k, v in r.items()))
    return report


if __name__ == "__main__":
    main()
