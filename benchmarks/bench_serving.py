"""Serving benchmark: the HTTP server as users run it, full attention and ShadowKV side by side.

Each attention mode gets its own server (started in its own process group, default flags plus the
preset's model and sizes, stopped with its whole group), driven by concurrent streaming clients over
the native /generate route (input_ids, greedy, ignore_eos, so every request decodes exactly its
max_new_tokens). Metrics are named as SGLang's serving benchmark names them: TTFT, ITL (the gaps
between streamed tokens), TPOT ((e2e - ttft) / (output tokens - 1)) and end-to-end latency, each
mean/p50/p99 in ms; request, output and total (prompt + output) throughput; plus the server's own
counters over the timed phase (prefilled and cache-hit tokens, compressions, compressed-prefix hits)
and its memory (dense pool, GPU and host bytes of compressed state).

Scenarios:
- `decode`: N requests, each over its own L-token document (cached first by a load phase), a short
  question, then `--decode-tokens` tokens (256 on the GPU). Where full attention's pool cannot hold
  all N documents, it holds what fits and re-prefills the rest. `decode_tok_s`: output tokens after
  each request's first, over the time from the first first-token to the last token.
- `shared_document`: D documents of L tokens, cached first, N concurrent questions on each.
- `multi_session`: S chat sessions, each over its own (uncached) document of L tokens, T turns each
  (question, the answer appended, the next question), at most C requests in flight and a think time
  between a session's turns, sessions interleaved (SCBench's multi-turn shared-context shape).

Per case a `shadowkv_vs_full` object: `decode` (ShadowKV decode tok/s over full's), `throughput`
(total tok/s over full's) and `ttft_p50` (full's TTFT p50 over ShadowKV's). With --graph-steps (a
bench_throughput.py JSON from the same session) each decode case also gets `graph_step_ms` of that
mode at its batch and context, and `itl_vs_graph_step` (the server's ITL p50 over it).

    python benchmarks/bench_serving.py                              # CPU preset, embedded model
    python benchmarks/bench_serving.py --preset h100 --tokenizer-path .tok --graph-steps T.json
    python benchmarks/bench_serving.py --preset h100 --scenarios decode --decode-cases 32768x8

Writes $OUT/serving_<preset>.json (or --out) and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
import orjson

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.live_server import LiveServer  # noqa: E402


@dataclass
class Preset:
    server_flags: list[str]
    decode_cases: list[tuple[int, int]]  # (context L, requests N)
    decode_tokens: int
    shared_document: list[tuple[int, int, int]]  # (documents D, context L, questions per document N)
    multi_session: list[tuple[int, int, int, int]]  # (sessions S, context L, turns T, in flight C)
    answer_tokens: int  # output tokens of a question in shared_document / multi_session
    think_s: float  # multi_session: a user's pause between turns (uniform in [0, 2 think_s])


PRESETS = {
    # the embedded model on a CPU: documents just above ShadowKV's 4096-token threshold
    "cpu": Preset(["--max-total-tokens", "24576", "--chunked-prefill-size", "1024"],
                  decode_cases=[(4608, 2)], decode_tokens=16, shared_document=[(1, 4608, 3)],
                  multi_session=[(3, 4608, 2, 2)], answer_tokens=8, think_s=0.5),
    # a few seconds per mode: what the test runs (ShadowKV's threshold lowered to fit)
    "test": Preset(["--max-total-tokens", "8192", "--chunked-prefill-size", "512",
                    "--shadowkv-min-context", "512"],
                   decode_cases=[(640, 2)], decode_tokens=6, shared_document=[(1, 640, 2)],
                   multi_session=[(2, 640, 2, 1)], answer_tokens=4, think_s=0.05),
    # the Llama-3.1-8B shape with random weights on the H100 (the issue's scenarios)
    "h100": Preset(["--model-path", "random:llama-3.1-8b", "--context-length", "67584",
                    "--max-running-requests", "48"],
                   decode_cases=[(32768, 8), (32768, 32), (65536, 8), (65536, 32)], decode_tokens=256,
                   shared_document=[(2, 32768, 16), (1, 65536, 16)],
                   multi_session=[(48, 16384, 6, 16)], answer_tokens=32, think_s=2.0),
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


async def run_all(url: str, jobs: list[tuple[list[int], int]], concurrency: int) -> list[Result]:
    """Every (input_ids, new_tokens) job, at most `concurrency` in flight."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=None) as client:
        async def one(job):
            async with gate:
                return await stream_generate(client, url, *job)
        return list(await asyncio.gather(*(one(j) for j in jobs)))


# ---- workloads ----------------------------------------------------------------------------------
def random_tokens(rng: np.random.Generator, n: int) -> list[int]:
    """Ordinary token ids (no special tokens: those sit at the ends of the vocabularies used)."""
    return rng.integers(1000, 30000, n).tolist()


async def load_documents(url: str, docs: list[list[int]]) -> None:
    """Cache the documents (a prompt with max_new_tokens 0), a few at a time."""
    results = await run_all(url, [(d, 0) for d in docs], concurrency=4)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"loading documents failed: {errors[0]}")


async def scenario_decode(url: str, preset: Preset, context: int, requests: int, rng) -> dict:
    docs = [random_tokens(rng, context) for _ in range(requests)]
    await load_documents(url, docs)
    jobs = [(d + random_tokens(rng, QUESTION_TOKENS), preset.decode_tokens) for d in docs]
    return await timed(url, lambda: run_all(url, jobs, concurrency=len(jobs)))


async def scenario_shared_document(url: str, preset: Preset, documents: int, context: int,
                                   questions: int, rng) -> dict:
    docs = [random_tokens(rng, context) for _ in range(documents)]
    await load_documents(url, docs)
    jobs = [(d + random_tokens(rng, QUESTION_TOKENS), preset.answer_tokens) for d in docs for _ in range(questions)]
    random.Random(0).shuffle(jobs)
    return await timed(url, lambda: run_all(url, jobs, concurrency=len(jobs)))


async def scenario_multi_session(url: str, preset: Preset, sessions: int, context: int, turns: int,
                                 in_flight: int, rng) -> dict:
    docs = [random_tokens(rng, context) for _ in range(sessions)]
    questions = [[random_tokens(rng, QUESTION_TOKENS) for _ in range(turns)] for _ in range(sessions)]
    pauses = random.Random(1)

    async def run():
        gate = asyncio.Semaphore(in_flight)
        async with httpx.AsyncClient(timeout=None) as client:
            async def session(i):
                history, results = list(docs[i]), []
                await asyncio.sleep(pauses.uniform(0, 2 * preset.think_s))  # users arrive spread out
                for t in range(turns):
                    history += questions[i][t]
                    async with gate:
                        res = await stream_generate(client, url, list(history), preset.answer_tokens)
                    results.append(res)
                    history += res.output_ids
                    await asyncio.sleep(pauses.uniform(0, 2 * preset.think_s))
                return results
            per_session = await asyncio.gather(*(session(i) for i in range(sessions)))
        return [r for rs in per_session for r in rs]

    return await timed(url, run)


async def timed(url: str, run) -> dict:
    """Run a workload; its metrics and the server counters it moved."""
    before = server_info(url)
    t0 = time.perf_counter()
    results = await run()
    duration = time.perf_counter() - t0
    after = server_info(url)
    return {**metrics(results, duration), "server": counter_delta(before, after)}


# ---- metrics ------------------------------------------------------------------------------------
def summary_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    arr = np.asarray(values) * 1000
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


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


def counter_delta(before: dict, after: dict) -> dict:
    """What the timed phase did, by the server's counters, and its memory at the end."""
    delta = {k: after["stats"][k] - before["stats"].get(k, 0) for k in after["stats"]}
    shadow_b, shadow_a = before.get("shadowkv") or {}, after.get("shadowkv") or {}
    for key in ("compressions", "tail_compressions", "compressed_prefix_hits", "compressed_tokens_reused"):
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
        out += [("multi_session", f"multi_session/{S}x{L}x{T}/c{C}", (S, L, T, C))
                for S, L, T, C in preset.multi_session]
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
            httpx.post(live.url + "/flush_cache", timeout=60)
            print(f"[{attention}] {name} ...", flush=True)
            t0 = time.perf_counter()
            result = asyncio.run(SCENARIOS[kind](live.url, preset, *params, np.random.default_rng(0)))
            print(f"[{attention}] {name}: {time.perf_counter() - t0:.0f} s, ITL p50 "
                  f"{result['itl_p50_ms'] or 0:.1f} ms, TTFT p50 {result['ttft_p50_ms'] or 0:.0f} ms, "
                  f"{result['num_errors']} errors", flush=True)
            out["cases"][name] = {"scenario": kind, "params": list(params), **result}
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


def compare(report: dict, graph_rows: list[dict] | None) -> None:
    modes = report["modes"]
    for name in next(iter(modes.values()))["cases"]:
        per = {m: modes[m]["cases"].get(name) for m in modes}
        if graph_rows is not None and name.startswith("decode/"):
            L, N = per[next(iter(per))]["params"]
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


def print_table(report: dict) -> None:
    print(f"\nserving benchmark, {report['device']}, preset {report['preset']}")
    head = f"{'case':34} {'mode':9} {'TTFT p50':>9} {'ITL p50':>8} {'graph':>7} {'TPOT p50':>9} " \
           f"{'out tok/s':>9} {'decode tok/s':>12} {'total tok/s':>11} {'prefilled':>10} {'vs full':>30}"
    print(head)
    for mode, data in report["modes"].items():
        for name, c in data["cases"].items():
            vs = c.get("shadowkv_vs_full")
            vs_txt = "" if not vs else " ".join(f"{k[:3]} {v:.2f}" for k, v in vs.items() if v is not None)
            fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
            print(f"{name:34} {mode:9} {fmt(c['ttft_ms']['p50'], '9.0f')} {fmt(c['itl_ms']['p50'], '8.1f')} "
                  f"{fmt(c.get('graph_step_ms'), '7.1f')} {fmt(c['tpot_ms']['p50'], '9.1f')} "
                  f"{c['output_tok_s']:9.1f} {c['decode_tok_s']:12.1f} {c['total_tok_s']:11.0f} "
                  f"{c['server']['counters'].get('prefill_tokens', 0):10d} {vs_txt:>30}")


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
    ap.add_argument("--tokenizer-path", default=None, help="tokenizer folder for a random:* model")
    ap.add_argument("--server-args", default="", help="extra server flags for both modes (one string)")
    ap.add_argument("--graph-steps", default=None,
                    help="bench_throughput.py JSON of this session: adds graph_step_ms to decode cases")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT or benchmarks/results/serving_<preset>.json)")
    args = ap.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.decode_cases is not None:
        preset.decode_cases = [tuple(int(x) for x in c.split("x")) for c in args.decode_cases]
    extra = args.server_args.split()
    if args.tokenizer_path:
        extra += ["--tokenizer-path", args.tokenizer_path]
    todo = cases(preset, args.scenarios)
    report = {"device": device_name(), "preset": args.preset, "question_tokens": QUESTION_TOKENS,
              "decode_tokens": preset.decode_tokens, "answer_tokens": preset.answer_tokens, "modes": {}}
    for attention in args.attention:
        report["modes"][attention] = run_mode(attention, preset, todo, extra)
    graph_rows = None
    if args.graph_steps:
        with open(args.graph_steps) as f:
            graph_rows = json.load(f)["rows"]
    compare(report, graph_rows)
    out = args.out or os.path.join(os.environ.get("OUT", "benchmarks/results"), f"serving_{args.preset}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print_table(report)
    print(f"\nwrote {out}")
    return report


if __name__ == "__main__":
    main()
