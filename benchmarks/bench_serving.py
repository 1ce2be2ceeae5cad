"""Serving benchmark: the HTTP server as users run it, full attention and ShadowKV side by side.

Each attention mode gets its own server (started in its own process group, default flags plus the
preset's model and sizes, stopped with its whole group), driven by concurrent streaming clients over
the native /generate route (input_ids, greedy, ignore_eos, so every request decodes exactly its
max_new_tokens). Metrics are named as SGLang's serving benchmark names them: TTFT, ITL (the gaps
between streamed tokens), TPOT ((e2e - ttft) / (output tokens - 1)) and end-to-end latency, each
mean/p50/p90/p99 in ms; request, output and total (prompt + output) throughput; plus the server's own
counters over the timed phase (prefilled, cache-hit and re-prefilled tokens, dense and compressed
prefix hits, compressions, demotions) and its memory (dense pool, GPU and host bytes of compressed
state).

What users see, by default:
- Cold documents (`--documents cold`): nothing is loaded before the clock starts, so each document's
  first prefill (and with ShadowKV its compression, if any) is inside the timed phase and in its
  requests' TTFT. `--documents warm` caches the documents first (a prompt with max_new_tokens 0,
  outside the clock), to time requests over documents already cached: under ShadowKV's default
  `tier` compress policy they stay dense while the pool holds them (dense prefix hits) and are
  compressed only under memory pressure (demotions).
- Arrivals while others decode: requests (multi_session: sessions) arrive as a Poisson process at
  `--request-rate` per second (the preset's by default), so later ones are prefilled while earlier
  ones decode; `--request-rate inf` sends them all at t=0 (the batch-N decode that --graph-steps
  compares with).

Scenarios:
- `decode`: N requests, each over its own L-token document, a short question, then `--decode-tokens`
  tokens (256 on the GPU). With warm documents, where full attention's pool cannot hold all N, it
  holds what fits and re-prefills the rest. `decode_tok_s`: output tokens after each request's first,
  over the time from the first first-token to the last token.
- `shared_document`: D documents of L tokens, N questions on each, in random order.
- `multi_session`: S chat sessions, each over its own document of L tokens, T turns each (question,
  the answer appended, the next question), at most C requests in flight, sessions interleaved
  (SCBench's multi-turn shared-context shape). Think time W: a pause uniform in [0, 2W] s before each
  turn (a user reading and typing); W = 0: closed loop, each turn sent as soon as the last answer
  arrived. The presets run both.

Per case a `shadowkv_vs_full` object: `decode` (ShadowKV decode tok/s over full's), `throughput`
(total tok/s over full's) and `ttft_p50` (full's TTFT p50 over ShadowKV's). With --graph-steps (a
bench_throughput.py JSON from the same session) each decode case also gets `graph_step_ms` of that
mode at its batch and context, and `itl_vs_graph_step` (the server's ITL p50 over it). The report and
each case record `documents` and `request_rate` (null: all at t=0).

    python benchmarks/bench_serving.py                              # CPU preset, embedded model
    python benchmarks/bench_serving.py --preset h100 --tokenizer-path .tok --graph-steps T.json
    python benchmarks/bench_serving.py --preset h100 --scenarios decode --decode-cases 32768x8 \\
        --documents warm --request-rate inf                        # batch-N decode over cached documents

Writes $OUT/serving_<preset>.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import orjson

from sglang_shadowkv.testing.live_server import LiveServer, wait_idle


@dataclass
class Preset:
    server_flags: list[str]
    decode_cases: list[tuple[int, int]]  # (context L, requests N)
    decode_tokens: int
    shared_document: list[tuple[int, int, int]]  # (documents D, context L, questions per document N)
    # (sessions S, context L, turns T, in flight C, think time W in s; 0: closed loop)
    multi_session: list[tuple[int, int, int, int, float]]
    answer_tokens: int  # output tokens of a question in shared_document / multi_session
    request_rate: float  # Poisson arrivals per second of requests (multi_session: sessions); inf: all at t=0
    documents: str = "cold"  # cold: first prefilled in the timed phase; warm: cached before it
    profile_steps: int = 0  # profile this many scheduler steps of a second run of each case

    def run_settings(self) -> dict:
        """How the cases were driven, for the report (JSON has no inf: null, all at t=0)."""
        return {"documents": self.documents,
                "request_rate": None if math.isinf(self.request_rate) else self.request_rate}


PRESETS = {
    # the embedded model on a CPU: documents just above ShadowKV's 4096-token threshold
    "cpu": Preset(["--max-total-tokens", "24576", "--chunked-prefill-size", "1024"],
                  decode_cases=[(4608, 2)], decode_tokens=16, shared_document=[(1, 4608, 3)],
                  multi_session=[(3, 4608, 2, 2, 0.5), (3, 4608, 2, 2, 0)], answer_tokens=8, request_rate=0.2),
    # a few seconds per mode: what the test runs (ShadowKV's threshold lowered to fit)
    "test": Preset(["--max-total-tokens", "8192", "--chunked-prefill-size", "512",
                    "--shadowkv-min-context", "512"],
                   decode_cases=[(640, 2)], decode_tokens=6, shared_document=[(1, 640, 2)],
                   multi_session=[(2, 640, 2, 1, 0.05), (2, 640, 2, 1, 0)], answer_tokens=4, request_rate=4.0),
    # the Llama-3.1-8B shape with random weights on the H100 (the scenarios); multi_session:
    # three times the 27 documents of 16K that full attention's pool holds there at default flags
    "h100": Preset(["--model-path", "random:llama-3.1-8b", "--context-length", "67584",
                    "--max-running-requests", "48"],
                   decode_cases=[(32768, 8), (32768, 32), (65536, 8), (65536, 32)], decode_tokens=256,
                   shared_document=[(2, 32768, 16), (1, 65536, 16)],
                   multi_session=[(81, 16384, 6, 16, 2.0), (81, 16384, 6, 16, 0)], answer_tokens=32,
                   request_rate=1.0),
}
QUESTION_TOKENS = 32


# ---- the client ---------------------------------------------------------------------------------
@dataclass
class Result:
    prompt_tokens: int
    ttft: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each output token
    start: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    error: str | None = None

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.start if self.token_times else 0.0


async def stream_generate(client: httpx.AsyncClient, url: str, input_ids: list[int], new_tokens: int) -> Result:
    """One streaming request; token arrival times as the client sees them."""
    res = Result(len(input_ids), start=time.perf_counter())
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    async with client.stream("POST", url + "/generate", json=body) as resp:
        if resp.status_code != 200:
            res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            return res
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[len("data: "):])
            now = time.perf_counter()
            got = event["output_ids"]
            if len(got) > len(res.output_ids):
                res.token_times += [now] * (len(got) - len(res.output_ids))
                res.output_ids = got
            res.cached_tokens = event["meta_info"].get("cached_tokens", 0)
    if res.token_times:
        res.ttft = res.token_times[0] - res.start
    return res


async def run_all(url: str, jobs: list[tuple[list[int], int]], concurrency: int,
                  arrivals: list[float] | None = None) -> list[Result]:
    """Every (input_ids, new_tokens) job, each sent at its arrival (seconds from now; default all at
    once), at most `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=None) as client:
        async def one(job, at):
            await asyncio.sleep(at)
            async with gate:
                return await stream_generate(client, url, *job)
        return list(await asyncio.gather(*(one(j, a) for j, a in zip(jobs, arrivals or [0.0] * len(jobs)))))


# ---- workloads ----------------------------------------------------------------------------------
def random_tokens(rng: np.random.Generator, n: int) -> list[int]:
    """Ordinary token ids (no special tokens: those sit at the ends of the vocabularies used)."""
    return rng.integers(1000, 30000, n).tolist()


def arrival_times(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """When each of n requests arrives, in seconds from the first: a Poisson process (exponential
    gaps) at `rate` per second, as SGLang's bench_serving sends them; all at 0 for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    return [0.0, *np.cumsum(rng.exponential(1 / rate, n - 1)).tolist()]


async def prepare(url: str, preset: Preset, docs: list[list[int]]) -> None:
    """Warm documents: cache them before the clock starts (a prompt with max_new_tokens 0, a few at
    a time). Cold ones are left for the timed requests to prefill."""
    if preset.documents == "cold":
        return
    results = await run_all(url, [(d, 0) for d in docs], concurrency=4)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"loading documents failed: {errors[0]}")


async def open_loop(url: str, preset: Preset, docs: list[list[int]], jobs: list[tuple[list[int], int]],
                    rng) -> dict:
    """Requests over these documents, each sent at its arrival whatever the others are doing."""
    await prepare(url, preset, docs)
    arrivals = arrival_times(len(jobs), preset.request_rate, rng)
    return await timed(url, preset, lambda: run_all(url, jobs, len(jobs), arrivals))


async def scenario_decode(url: str, preset: Preset, context: int, requests: int, rng) -> dict:
    docs = [random_tokens(rng, context) for _ in range(requests)]
    jobs = [(d + random_tokens(rng, QUESTION_TOKENS), preset.decode_tokens) for d in docs]
    return await open_loop(url, preset, docs, jobs, rng)


async def scenario_shared_document(url: str, preset: Preset, documents: int, context: int,
                                   questions: int, rng) -> dict:
    docs = [random_tokens(rng, context) for _ in range(documents)]
    jobs = [(d + random_tokens(rng, QUESTION_TOKENS), preset.answer_tokens) for d in docs for _ in range(questions)]
    random.Random(0).shuffle(jobs)
    return await open_loop(url, preset, docs, jobs, rng)


async def scenario_multi_session(url: str, preset: Preset, sessions: int, context: int, turns: int,
                                 in_flight: int, think: float, rng) -> dict:
    docs = [random_tokens(rng, context) for _ in range(sessions)]
    questions = [[random_tokens(rng, QUESTION_TOKENS) for _ in range(turns)] for _ in range(sessions)]
    arrivals = arrival_times(sessions, preset.request_rate, rng)
    pauses = random.Random(1)
    await prepare(url, preset, docs)

    async def run():
        gate = asyncio.Semaphore(in_flight)
        async with httpx.AsyncClient(timeout=None) as client:
            async def session(i):
                history, results = list(docs[i]), []
                await asyncio.sleep(arrivals[i])
                for t in range(turns):
                    await asyncio.sleep(pauses.uniform(0, 2 * think))  # the user reads and types (0: closed loop)
                    history += questions[i][t]
                    async with gate:
                        res = await stream_generate(client, url, list(history), preset.answer_tokens)
                    results.append(res)
                    history += res.output_ids
                return results
            per_session = await asyncio.gather(*(session(i) for i in range(sessions)))
        return [r for rs in per_session for r in rs]

    return await timed(url, preset, run)


async def timed(url: str, preset: Preset, run) -> dict:
    """Run a workload; its metrics and the server counters it moved. With profile_steps, the
    workload then runs once more with the server profiling its first steps (/start_profile; the
    profiler's overhead and its trace export stay out of the measured run), over cold documents
    again where the measured run had them cold."""
    before = server_info(url)
    t0 = time.perf_counter()
    results = await run()
    duration = time.perf_counter() - t0
    after = server_info(url)
    out = {**metrics(results, duration), "server": counter_delta(before, after)}
    if preset.profile_steps:
        if preset.documents == "cold":
            flush_cache(url)
        httpx.post(url + "/start_profile", json={"num_steps": preset.profile_steps}, timeout=60).raise_for_status()
        await run()
        profile = httpx.post(url + "/stop_profile", timeout=600).json()
        out["profile"] = {**profile, "top_ops": profile.get("top_ops", [])[:15]}
    return out


def flush_cache(url: str) -> None:
    """Drop the server's prefix cache (refused while a request runs: the last ones may still be
    finishing), so that no case finds another's documents cached."""
    wait_idle(url, timeout=120)
    httpx.post(url + "/flush_cache", timeout=60).raise_for_status()


# ---- metrics ------------------------------------------------------------------------------------
PERCENTILES = (50, 90, 99)


def summary_ms(values: list[float]) -> dict:
    """Mean and tail percentiles in ms (None without values): the tails are what a user waits on."""
    if not values:
        return dict.fromkeys(["mean", *(f"p{q}" for q in PERCENTILES)])
    arr = np.asarray(values) * 1000
    tails = np.percentile(arr, PERCENTILES)
    return {"mean": float(arr.mean()), **{f"p{q}": float(v) for q, v in zip(PERCENTILES, tails)}}


def metrics(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.error is None and r.token_times]
    itls = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:])]
    tpots = [(r.e2e - r.ttft) / (len(r.token_times) - 1) for r in ok if len(r.token_times) > 1]
    out_tokens = sum(len(r.token_times) for r in ok)
    first = min((r.start + r.ttft for r in ok), default=0.0)
    last = max((r.token_times[-1] for r in ok), default=0.0)
    decode_tokens = out_tokens - len(ok)
    ttft, itl = summary_ms([r.ttft for r in ok]), summary_ms(itls)
    return {
        "requests": len(results), "errors": [r.error for r in results if r.error is not None][:5],
        "num_errors": sum(r.error is not None for r in results), "duration_s": duration,
        "ttft_ms": ttft, "itl_ms": itl, "tpot_ms": summary_ms(tpots), "e2e_ms": summary_ms([r.e2e for r in ok]),
        "ttft_p50_ms": ttft["p50"], "itl_p50_ms": itl["p50"],
        "request_throughput": len(ok) / duration,
        "output_tok_s": out_tokens / duration,
        "total_tok_s": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration,
        "decode_tok_s": decode_tokens / (last - first) if last > first else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "client_cached_tokens": sum(r.cached_tokens for r in ok),
    }


def server_info(url: str) -> dict:
    return httpx.get(url + "/get_server_info", timeout=60).json()


DEMOTION_COUNTERS = ("demotions", "demoted_tokens", "demotions_abandoned")  # under "shadowkv", not "stats"


def counter_delta(before: dict, after: dict) -> dict:
    """What the timed phase did, by the server's counters ("stats": prefilled, cached, re-prefilled
    tokens, dense and compressed prefix hits, compressions; under "shadowkv" with the tier policy:
    demotions), and its memory at the end."""
    delta = {k: after["stats"][k] - before["stats"].get(k, 0) for k in after["stats"]}
    shadow_b, shadow_a = before.get("shadowkv") or {}, after.get("shadowkv") or {}
    for key in DEMOTION_COUNTERS:
        if key in shadow_a:
            delta[key] = shadow_a[key] - shadow_b.get(key, 0)
    mem = after["memory"]
    out = {"counters": delta, "dense_pool_bytes": mem["total_pages"] * mem["page_size"] * mem["kv_bytes_per_token"],
           "dense_tree_pages": mem["tree_pages"], "steps": after.get("steps")}
    if shadow_a:
        out["compressed_pools"] = shadow_a.get("pools")
        out["compressed_in_cache_tokens"] = shadow_a.get("radix_cache", {}).get("compressed_tokens")
        out["shadowkv_capacity"] = shadow_a.get("capacity")
    return out


# ---- the run ------------------------------------------------------------------------------------
def cases(preset: Preset, scenarios: list[str]) -> list[tuple[str, str, tuple]]:
    out = []
    if "decode" in scenarios:
        out += [("decode", f"decode/{L}x{N}", (L, N)) for L, N in preset.decode_cases]
    if "shared_document" in scenarios:
        out += [("shared_document", f"shared_document/{D}x{L}x{N}", (D, L, N)) for D, L, N in preset.shared_document]
    if "multi_session" in scenarios:
        out += [("multi_session", f"multi_session/{S}x{L}x{T}/c{C}/" + (f"think{W:g}s" if W else "closed"),
                 (S, L, T, C, W)) for S, L, T, C, W in preset.multi_session]
    return out


SCENARIOS = {"decode": scenario_decode, "shared_document": scenario_shared_document,
             "multi_session": scenario_multi_session}


def run_mode(attention: str, preset: Preset, todo, extra_flags: list[str]) -> dict:
    """Every case against one server of this attention mode (the cache flushed between cases)."""
    flags = [*preset.server_flags, "--attention", attention, *extra_flags]
    print(f"[{attention}] starting server: {' '.join(flags)}", flush=True)
    with LiveServer(*flags) as live:
        info = server_info(live.url)
        out = {"server_flags": flags, "startup": {k: info.get(k) for k in ("attention_backend", "device", "dtype",
                                                                            "context_length", "steps", "capacity")},
               "cases": {}}
        for kind, name, params in todo:
            flush_cache(live.url)
            print(f"[{attention}] {name} ...", flush=True)
            t0 = time.perf_counter()
            result = asyncio.run(SCENARIOS[kind](live.url, preset, *params, np.random.default_rng(0)))
            print(f"[{attention}] {name}: {time.perf_counter() - t0:.0f} s, ITL p50 "
                  f"{result['itl_p50_ms'] or 0:.1f} ms, TTFT p50/p99 {result['ttft_p50_ms'] or 0:.0f}/"
                  f"{result['ttft_ms']['p99'] or 0:.0f} ms, {result['num_errors']} errors", flush=True)
            out["cases"][name] = {"scenario": kind, "params": list(params), **preset.run_settings(), **result}
    return out


def graph_step_ms(rows: list[dict], attention: str, context: int, batch: int) -> float | None:
    """bench_throughput.py's CUDA-graph step time for this mode at this batch and context (ShadowKV:
    its calibrated workload with int8 storage, the server's default on a GPU)."""
    for row in rows:
        if row.get("context") != context or row.get("batch") != batch or "graph" not in row:
            continue
        if row["method"] == attention and (attention == "full" or (
                row.get("workload") == "calibrated" and row.get("storage") == "int8")):
            return row["graph"]["step_ms"]
    return None


def merge_reports(paths: list[str]) -> dict:
    """One report from several runs of this script (e.g. one device call per case): the cases of
    each mode side by side, each run's server startup kept with its cases."""
    reports = []
    for path in paths:
        with open(path) as f:
            reports.append(json.load(f))
    merged = {**reports[0], "modes": {}, "merged_from": [os.path.basename(p) for p in paths]}
    for report in reports:
        for mode, data in report["modes"].items():
            into = merged["modes"].setdefault(mode, {**data, "cases": {}})
            for name, case in data["cases"].items():
                into["cases"][name] = {**case, "startup": data["startup"]}
    return merged


def compare(report: dict, graph_rows: list[dict] | None) -> None:
    modes = report["modes"]
    for name in dict.fromkeys(n for m in modes.values() for n in m["cases"]):
        per = {m: modes[m]["cases"][name] for m in modes if name in modes[m]["cases"]}
        if graph_rows is not None and name.startswith("decode/"):
            L, N = next(iter(per.values()))["params"]
            for mode, case in per.items():
                step = graph_step_ms(graph_rows, mode, L, N)
                case["graph_step_ms"] = step
                case["itl_vs_graph_step"] = case["itl_p50_ms"] / step if step and case["itl_p50_ms"] else None
        full, skv = per.get("full"), per.get("shadowkv")
        if full and skv:
            ratio = lambda a, b: a / b if a and b else None  # noqa: E731
            skv["shadowkv_vs_full"] = {"decode": ratio(skv["decode_tok_s"], full["decode_tok_s"]),
                                       "throughput": ratio(skv["total_tok_s"], full["total_tok_s"]),
                                       "ttft_p50": ratio(full["ttft_p50_ms"], skv["ttft_p50_ms"])}


TABLE = [  # (title, width, format, the value of a case)
    ("TTFT p50", 9, ".0f", lambda c: c["ttft_ms"]["p50"]), ("p90", 7, ".0f", lambda c: c["ttft_ms"]["p90"]),
    ("p99", 7, ".0f", lambda c: c["ttft_ms"]["p99"]), ("ITL p50", 8, ".1f", lambda c: c["itl_ms"]["p50"]),
    ("p99", 7, ".1f", lambda c: c["itl_ms"]["p99"]), ("graph", 7, ".1f", lambda c: c.get("graph_step_ms")),
    ("TPOT p50", 9, ".1f", lambda c: c["tpot_ms"]["p50"]), ("out tok/s", 9, ".1f", lambda c: c["output_tok_s"]),
    ("decode tok/s", 12, ".1f", lambda c: c["decode_tok_s"]), ("total tok/s", 11, ".0f", lambda c: c["total_tok_s"]),
    ("prefilled", 10, "d", lambda c: c["server"]["counters"].get("prefill_tokens", 0)),
]


def print_table(report: dict) -> None:
    rate = report["request_rate"]
    print(f"\nserving benchmark, {report['device']}, preset {report['preset']}, {report['documents']} documents, "
          f"arrivals {'all at t=0' if rate is None else f'{rate:g}/s'}")
    titles = " ".join(f"{title:>{width}}" for title, width, _, _ in TABLE)
    print(f"{'case':38} {'mode':9} {titles} {'vs full':>30}")
    for mode, data in report["modes"].items():
        for name, c in data["cases"].items():
            vs = c.get("shadowkv_vs_full")
            vs_txt = "" if not vs else " ".join(f"{k[:3]} {v:.2f}" for k, v in vs.items() if v is not None)
            cells = " ".join(f"{'-' if get(c) is None else format(get(c), spec):>{width}}"
                             for _, width, spec, get in TABLE)
            print(f"{name:38} {mode:9} {cells} {vs_txt:>30}")


def device_name() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return "CPU"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--preset", default="cpu", choices=sorted(PRESETS),
                    help="sizes and model: cpu (embedded model, minutes), h100 (8B shape), test (seconds)")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--attention", nargs="+", default=["full", "shadowkv"], choices=["full", "shadowkv"])
    ap.add_argument("--decode-cases", nargs="*", default=None, metavar="LxN",
                    help="override the preset's decode cases, e.g. 32768x8 65536x32")
    ap.add_argument("--shared-document", nargs="*", default=None, metavar="DxLxN",
                    help="override the preset's shared_document cases, e.g. 2x32768x16")
    ap.add_argument("--multi-session", nargs="*", default=None, metavar="SxLxTxCxW",
                    help="override the preset's multi_session cases, W the think time in s (0: closed loop), "
                         "e.g. 72x16384x6x16x2 72x16384x6x16x0")
    ap.add_argument("--documents", default="cold", choices=["cold", "warm"],
                    help="cold: each document's first prefill (and compression) is timed, in its requests' "
                         "TTFT; warm: the documents are cached before the clock starts (default: %(default)s)")
    ap.add_argument("--request-rate", type=float, default=None, metavar="R",
                    help="Poisson arrivals of R requests (multi_session: sessions) per second, so later ones "
                         "arrive while earlier ones decode; inf: all at t=0 (default: the preset's)")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="run each case twice, profiling the first N scheduler steps of the second run (/start_profile)")
    ap.add_argument("--tokenizer-path", default=None, help="tokenizer folder for a random:* model")
    ap.add_argument("--server-args", default="", help="extra server flags for both modes (one string)")
    ap.add_argument("--graph-steps", default=None,
                    help="bench_throughput.py JSON of this session: adds graph_step_ms to decode cases")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="run nothing: merge these reports of earlier runs (and compare, print, write --out)")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT or benchmarks/results/serving_<preset>.json)")
    args = ap.parse_args(argv)
    if args.merge:
        return finish(merge_reports(args.merge), args)
    overrides = {name: [tuple(int(x) if x.isdigit() else float(x) for x in c.split("x")) for c in given]
                 for name in ("decode_cases", "shared_document", "multi_session")
                 if (given := getattr(args, name)) is not None}
    if args.request_rate is not None:
        overrides["request_rate"] = args.request_rate
    preset = dataclasses.replace(PRESETS[args.preset], documents=args.documents, profile_steps=args.profile_steps,
                                 **overrides)
    extra = args.server_args.split()
    if args.tokenizer_path:
        extra += ["--tokenizer-path", args.tokenizer_path]
    todo = cases(preset, args.scenarios)
    report = {"device": device_name(), "preset": args.preset, "question_tokens": QUESTION_TOKENS,
              "decode_tokens": preset.decode_tokens, "answer_tokens": preset.answer_tokens,
              **preset.run_settings(), "modes": {}}
    for attention in args.attention:
        report["modes"][attention] = run_mode(attention, preset, todo, extra)
    return finish(report, args)


def finish(report: dict, args) -> dict:
    """Add the comparisons, write the JSON, print the table."""
    graph_rows = None
    if args.graph_steps:
        with open(args.graph_steps) as f:
            graph_rows = json.load(f)["rows"]
    compare(report, graph_rows)
    out = args.out or os.path.join(os.environ.get("OUT", "benchmarks/results"), f"serving_{report['preset']}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print_table(report)
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main()
