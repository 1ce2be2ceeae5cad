"""Soak: a local server under a steady mix of traffic for minutes, then a check that it gave back
everything it took.

Each run starts `launch_server` (the embedded model unless --model-path) in one attention mode and
lets --clients concurrent clients loop over a weighted mix of requests until --minutes have passed:
plain and streaming /generate, OpenAI chat and completions, questions on a few long shared
documents (longer than --shadowkv-min-context; the ShadowKV server runs the eager policy, so it
compresses them once and later questions reuse the compressed prefix), client disconnects in the middle of a stream or
while waiting for a plain answer, /abort_request on a running stream, bad inputs (each must be a
400) and /flush_cache (200, or 400 while requests run). Every few seconds it samples the server's
pools (/get_server_info) and the RSS of the server's whole process group.

Every --checkpoint-s seconds and at the end the clients pause and, once the server is idle,
every KV page, ShadowKV segment, host slot, chunk reference and scratch row must be free or held
by the radix tree (`leaks`, all zero), and all free after a flush (the documents are then
prefilled and compressed again). No request may have had a 5xx or any other answer its kind does
not expect. The JSON (a `runs` list, one per mode, with attention, duration_s, requests, http_5xx,
leaks, checkpoints, outcomes by kind, p50/p99 latency and the RSS / pool / latency series) and a
PNG plot of memory and latency over time are written next to each other. The exit status is 1
when a run failed its checks.

    python benchmarks/soak.py --minutes 20 --attention both     # the committed CPU soak
    python benchmarks/soak.py --minutes 1 --attention shadowkv  # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import uuid
from collections import Counter, defaultdict

import httpx
import orjson

from sglang_shadowkv.testing.corpus import paragraphs
from sglang_shadowkv.testing.live_server import SMALL, LiveServer, pool_leaks, wait_idle

CHARS_PER_TOKEN = 5  # generous for English prose, so that a document has at least the tokens asked
SHORT_PROMPTS = ["The capital of France is", "Count: 1, 2, 3,", "Write a haiku about rain.",
                 "List three colors:", "Q: What is 7 times 8?\nA:", "Once upon a time"]
QUESTIONS = ["What is this text about?", "Summarize the first paragraph.", "Name one function mentioned.",
             "Which module is described?", "Give a title for this text."]
# kind -> weight; each kind is one method of Traffic
MIX = {"plain": 18, "stream": 14, "document": 20, "openai": 10, "disconnect_stream": 7,
       "disconnect_plain": 4, "abort": 5, "bad_input": 12, "flush": 2}
GENERATION_KINDS = ("plain", "stream", "document", "openai")  # their successful latencies are reported
# outcomes each kind may have; anything else (5xx, another status, a timeout, a broken stream) is an error
EXPECTED = {kind: {"ok"} for kind in MIX} | {
    "disconnect_stream": {"disconnected", "ok"}, "disconnect_plain": {"disconnected", "ok"},
    "abort": {"aborted", "ok"}, "bad_input": {"http_400"}, "flush": {"ok", "http_400"}}
ANSWER_TIMEOUT_S = 300.0  # a hang, not a slow answer: a CPU shared with other work is slow


def shared_documents(count: int, tokens: int) -> list[str]:
    """`count` documents of at least `tokens` tokens, each of consecutive stdlib docstring paragraphs."""
    paras, docs = paragraphs(), []
    for i in range(count):
        at, text = i * len(paras) // count, ""
        while len(text) < tokens * CHARS_PER_TOKEN:
            text += paras[at % len(paras)] + "\n\n"
            at += 1
        docs.append(text)
    return docs


def bad_inputs(context_length: int) -> list[tuple[str, bytes]]:
    """(route, body) pairs that must each be a 400 naming what is wrong."""
    def body(**fields) -> bytes:
        return orjson.dumps(fields)
    return [
        ("/generate", b'{"text": "unterminated'),
        ("/generate", b"[1, 2, 3]"),
        ("/generate", body(text=5)),
        ("/generate", body(text="hi", sampling_params={"max_new_tokens": -1})),
        ("/generate", body(text="hi", sampling_params={"temperature": "hot"})),
        ("/generate", body(text="hi", sampling_params={"logit_bias": {"not-a-token": 1.0}})),
        ("/generate", body(text="hi", sampling_params={"stop_token_ids": [10**12]})),
        ("/generate", body(text="hi", no_such_field=1)),
        ("/generate", body(text="hi", lora_path="adapter")),
        ("/generate", body(input_ids=[10**9])),
        ("/generate", body(input_ids=[100] * (context_length + 8))),
        ("/v1/chat/completions", body(messages="hi")),
        ("/v1/chat/completions", body(messages=[{"role": "user", "content": "hi"}], top_logprobs=-1)),
        ("/v1/completions", body(prompt="hi", n=0)),
        ("/v1/completions", body(prompt="hi", max_tokens=float("1e30"))),
        ("/abort_request", body(rid=7)),
    ]


class Traffic:
    """The request kinds of the mix, each returning its outcome ("ok", "http_400", ...)."""

    def __init__(self, client: httpx.AsyncClient, docs: list[str], context_length: int):
        self.client, self.docs = client, docs
        self.bad = bad_inputs(context_length)

    async def plain(self, rng: random.Random) -> str:
        resp = await self.client.post("/generate", json={"text": rng.choice(SHORT_PROMPTS),
                                                          "sampling_params": _sampling(rng)})
        return _status(resp)

    async def stream(self, rng: random.Random) -> str:
        return await self._stream("/generate", {"text": rng.choice(SHORT_PROMPTS),
                                                "sampling_params": _sampling(rng), "stream": True})

    async def document(self, rng: random.Random) -> str:
        body = self._document_body(rng)
        if rng.random() < 0.5:
            return await self._stream("/generate", {**body, "stream": True})
        return _status(await self.client.post("/generate", json=body))

    async def openai(self, rng: random.Random) -> str:
        common = {"max_tokens": rng.randint(4, 16), "temperature": rng.choice([0, 0.8]),
                  "stream": rng.random() < 0.5}
        if rng.random() < 0.5:
            route, body = "/v1/chat/completions", {**common, "messages": [
                {"role": "user", "content": rng.choice(SHORT_PROMPTS)}]}
        else:
            route, body = "/v1/completions", {**common, "prompt": rng.choice(SHORT_PROMPTS)}
        if body["stream"]:
            return await self._stream(route, body)
        return _status(await self.client.post(route, json=body))

    async def disconnect_stream(self, rng: random.Random) -> str:
        """Read a few events of a long stream, then hang up."""
        body = {**self._document_body(rng, new_tokens=64), "stream": True}
        async with self.client.stream("POST", "/generate", json=body) as resp:
            if resp.status_code != 200:
                return _status(resp)
            events = rng.randint(1, 3)
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    return "ok"
                events -= line.startswith("data: ")
                if events == 0:
                    return "disconnected"
        return "broken_stream"

    async def disconnect_plain(self, rng: random.Random) -> str:
        """Give up on a plain request long before it can finish."""
        try:
            resp = await self.client.post("/generate", json=self._document_body(rng, new_tokens=64),
                                          timeout=rng.uniform(0.05, 0.5))
        except httpx.TimeoutException:
            return "disconnected"
        return _status(resp)

    async def abort(self, rng: random.Random) -> str:
        rid = uuid.uuid4().hex
        body = {**self._document_body(rng, new_tokens=64), "stream": True, "rid": rid}
        async with self.client.stream("POST", "/generate", json=body) as resp:
            if resp.status_code != 200:
                return _status(resp)
            finish, aborted = None, False
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if not aborted:
                    abort = await self.client.post("/abort_request", json={"rid": rid})
                    if abort.status_code != 200:
                        return "abort_" + _status(abort)
                    aborted = True
                finish = orjson.loads(line[len("data: "):])["meta_info"].get("finish_reason")
        if finish is None:
            return "broken_stream"
        return "aborted" if finish["type"] == "abort" else "ok"

    async def bad_input(self, rng: random.Random) -> str:
        route, content = rng.choice(self.bad)
        resp = await self.client.post(route, content=content, headers={"content-type": "application/json"})
        if resp.status_code == 400 and "internal error" in resp.text:
            return "internal_error"
        return _status(resp)

    async def flush(self, rng: random.Random) -> str:
        return _status(await self.client.post("/flush_cache"))

    def _document_body(self, rng: random.Random, new_tokens: int | None = None) -> dict:
        text = rng.choice(self.docs) + "Question: " + rng.choice(QUESTIONS) + "\nAnswer:"
        return {"text": text, "sampling_params": _sampling(rng, new_tokens)}

    async def _stream(self, route: str, body: dict) -> str:
        """A streamed answer read to its end: ok when it ends with [DONE]."""
        async with self.client.stream("POST", route, json=body) as resp:
            if resp.status_code != 200:
                return _status(resp)
            last = None
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    last = line
        return "ok" if last == "data: [DONE]" else "broken_stream"


def _sampling(rng: random.Random, new_tokens: int | None = None) -> dict:
    return {"max_new_tokens": new_tokens or rng.randint(4, 16), "temperature": rng.choice([0, 0.7]),
            "ignore_eos": new_tokens is not None}


def _status(resp: httpx.Response) -> str:
    return "ok" if resp.status_code == 200 else f"http_{resp.status_code}"


class Recorder:
    """Every request's outcome and latency, and the server's state over time."""

    def __init__(self):
        self.start = time.monotonic()
        self.outcomes: dict[str, Counter] = defaultdict(Counter)
        self.latencies: list[tuple[float, str, float]] = []  # (end time, kind, seconds) of served requests
        self.samples: list[dict] = []
        self.checkpoints: list[dict] = []  # pool checks of the idle server (pool_check), the last at the end

    def now(self) -> float:
        return time.monotonic() - self.start

    def record(self, kind: str, outcome: str, began: float) -> None:
        self.outcomes[kind][outcome] += 1
        if outcome == "ok" and kind in GENERATION_KINDS:
            self.latencies.append((self.now(), kind, self.now() - began))

    @property
    def requests(self) -> int:
        return sum(sum(c.values()) for c in self.outcomes.values())

    @property
    def http_5xx(self) -> int:
        return sum(n for c in self.outcomes.values() for outcome, n in c.items()
                   if outcome.removeprefix("abort_").startswith("http_5"))

    @property
    def unexpected(self) -> dict[str, int]:
        return {f"{kind}:{outcome}": n for kind, c in self.outcomes.items() for outcome, n in c.items()
                if outcome not in EXPECTED[kind]}

    def latency_summary(self, since: float = 0.0, kind: str | None = None) -> dict:
        """Served requests, p50 and p99 latency of those that ended after `since` (of one kind)."""
        values = sorted(lat for end, k, lat in self.latencies if end >= since and kind in (None, k))
        return {"served": len(values), "p50_s": _percentile(values, 50), "p99_s": _percentile(values, 99)}


def _percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, round(q / 100 * (len(sorted_values) - 1)))]


class Gate:
    """Lets clients start requests, except while a checkpoint waits for the server to go idle."""

    def __init__(self):
        self.open = asyncio.Event()
        self.open.set()
        self.in_flight = 0

    async def drain(self) -> None:
        """Close the gate and wait for the requests in flight to end."""
        self.open.clear()
        while self.in_flight:
            await asyncio.sleep(0.1)


async def client_loop(traffic: Traffic, rec: Recorder, gate: Gate, rng: random.Random, deadline: float) -> None:
    kinds, weights = list(MIX), list(MIX.values())
    while True:
        await gate.open.wait()
        if rec.now() >= deadline:
            return
        kind = rng.choices(kinds, weights)[0]
        began = rec.now()
        gate.in_flight += 1
        try:
            outcome = await getattr(traffic, kind)(rng)
        except httpx.TimeoutException:
            outcome = "timeout"
        except httpx.TransportError as err:
            outcome = f"transport_{type(err).__name__}"
        finally:
            gate.in_flight -= 1
        rec.record(kind, outcome, began)


def pool_check(url: str) -> dict:
    """Once the server is idle: what it has not given back (`leaks`), then whether a flush frees
    every page, segment, host slot and scratch row."""
    leaks = pool_leaks(wait_idle(url, timeout=ANSWER_TIMEOUT_S))
    flushed = httpx.post(url + "/flush_cache", timeout=ANSWER_TIMEOUT_S).status_code == 200
    info = wait_idle(url)
    mem, skv = info["memory"], info["shadowkv"]
    # what a flush leaves held: the compressed pool's null page, and segments only if some leaked
    all_free = flushed and mem["free_pages"] + mem.get("compressed_pages", 0) == mem["total_pages"]
    if skv is not None:
        held = skv["holders"]
        all_free = all_free and all(held[f"free_{what}"] == held[what]
                                    for what in ("segments", "chunk_slots", "scratch_rows"))
    return {"leaks": leaks, "flushed": flushed, "all_free_after_flush": all_free}


async def checkpoint_loop(url: str, rec: Recorder, gate: Gate, deadline: float, period: float,
                          progress) -> None:
    """Every `period` seconds: hold the clients, check the idle server's pools and flush."""
    while rec.now() + period < deadline:
        await asyncio.sleep(period)
        await gate.drain()
        check = await asyncio.to_thread(pool_check, url)
        rec.checkpoints.append({"t_s": round(rec.now(), 1), **check})
        progress(f"  {rec.now():7.0f} s  checkpoint: leaks {check['leaks']}, flushed {check['flushed']}, "
                 f"all free after the flush {check['all_free_after_flush']}")
        gate.open.set()


def server_sample(url: str, server: LiveServer, t: float) -> dict:
    """Pool occupancy (pages, ShadowKV slots) and the RSS of the server's process group."""
    resp = httpx.get(url + "/get_server_info", timeout=ANSWER_TIMEOUT_S)
    assert resp.status_code == 200, f"/get_server_info: {resp.status_code} {resp.text[:500]}"
    info = resp.json()
    mem, rss = info["memory"], 0
    for proc in server.group():
        try:
            rss += proc.memory_info().rss
        except Exception:  # psutil.NoSuchProcess: a process that just ended holds nothing
            pass
    sample = {"t_s": round(t, 1), "rss_mb": round(rss / 2**20, 1), "free_pages": mem["free_pages"],
              "tree_pages": mem["tree_pages"], "running_request_pages": mem["running_request_pages"],
              "total_pages": mem["total_pages"], "running_requests": info["running_requests"],
              "waiting_requests": info["waiting_requests"]}
    if info["shadowkv"] is not None:
        skv = info["shadowkv"]
        sample.update(segments=skv["pools"]["segments"], free_chunk_slots=skv["holders"]["free_chunk_slots"],
                      segment_gpu_bytes=skv["pools"]["segment_gpu_bytes"],
                      segment_host_bytes=skv["pools"]["segment_host_bytes"],
                      compressed_tokens=skv["compressed_tokens"],
                      compressed_prefix_hits=skv["compressed_prefix_hits"])
    return sample


async def sample_loop(url: str, server: LiveServer, rec: Recorder, deadline: float, period: float,
                      progress) -> None:
    last = 0.0
    while True:
        t = rec.now()
        sample = await asyncio.to_thread(server_sample, url, server, t)
        sample.update({f"window_{k}": v for k, v in rec.latency_summary(since=last).items()})
        rec.samples.append(sample)
        progress(f"  {t:7.0f} s  requests {rec.requests:6d}  5xx {rec.http_5xx}  "
                 f"unexpected {sum(rec.unexpected.values())}  p50 {_fmt(sample['window_p50_s'])}  "
                 f"p99 {_fmt(sample['window_p99_s'])}  rss {sample['rss_mb']:.0f} MB  "
                 f"pages used {sample['total_pages'] - sample['free_pages']}/{sample['total_pages']}"
                 + (f"  segments {sample['segments']}" if "segments" in sample else ""))
        last = t
        if t >= deadline:
            return
        await asyncio.sleep(min(period, max(0.0, deadline - rec.now())))


def _fmt(seconds: float | None) -> str:
    return "  -   " if seconds is None else f"{seconds:5.2f}s"


def server_flags(attention: str, args: argparse.Namespace) -> list[str]:
    flags = [*SMALL, "--attention", attention, "--max-running-requests", str(2 * args.clients)]
    if args.model_path:
        flags += ["--model-path", args.model_path]
    if attention == "shadowkv":
        flags += ["--shadowkv-min-context", str(args.shadowkv_min_context),
                  "--shadowkv-compress-policy", args.shadowkv_compress_policy]
    return flags


def run_soak(attention: str, args: argparse.Namespace, progress=print) -> dict:
    """One soak run against a fresh server; the run's record (`ok` says whether it passed)."""
    flags = server_flags(attention, args)
    progress(f"soak: attention={attention}, {args.minutes:g} min, {args.clients} clients, "
             f"server flags {' '.join(flags)}, {args.server_threads} torch thread(s)")
    with LiveServer(*flags, env={"OMP_NUM_THREADS": str(args.server_threads)}) as server:
        url = server.url
        context_length = httpx.get(url + "/get_model_info", timeout=30).json()["context_length"]
        docs = shared_documents(args.documents, args.doc_tokens)
        rec = Recorder()
        duration = args.minutes * 60

        async def soak() -> None:
            limits = httpx.Limits(max_connections=4 * args.clients)
            async with httpx.AsyncClient(base_url=url, timeout=ANSWER_TIMEOUT_S, limits=limits) as client:
                traffic, gate = Traffic(client, docs, context_length), Gate()
                rngs = [random.Random(args.seed * 1000 + i) for i in range(args.clients)]
                await asyncio.gather(sample_loop(url, server, rec, duration, args.sample_s, progress),
                                     checkpoint_loop(url, rec, gate, duration, args.checkpoint_s, progress),
                                     *(client_loop(traffic, rec, gate, rng, duration) for rng in rngs))

        try:
            asyncio.run(soak())
        except BaseException:
            progress("soak: the server's log ends with:\n" + server.output()[-6000:])
            raise
        duration_s = rec.now()
        skv = wait_idle(url)["shadowkv"]  # its counters, before the final flush
        rec.checkpoints.append({"t_s": round(rec.now(), 1), **pool_check(url)})
        final = server_sample(url, server, rec.now())
        healthy = server.healthy()
    run = {
        "attention": attention, "duration_s": round(duration_s, 1), "requests": rec.requests,
        "http_5xx": rec.http_5xx, "unexpected": rec.unexpected, "leaks": rec.checkpoints[-1]["leaks"],
        "checkpoints": rec.checkpoints, "healthy_after": healthy,
        "outcomes": {kind: dict(c) for kind, c in sorted(rec.outcomes.items())},
        "latency": {"all": rec.latency_summary(), **{k: rec.latency_summary(kind=k) for k in GENERATION_KINDS}},
        "rss_mb": {"start": rec.samples[0]["rss_mb"], "end": final["rss_mb"],
                   "max": max(s["rss_mb"] for s in rec.samples)},
        "shadowkv": None if skv is None else {k: skv[k] for k in (
            "compressed_tokens", "compressions", "tail_compressions", "compressed_prefix_hits",
            "compressed_tokens_reused")},
        "server_flags": flags, "server_threads": args.server_threads, "clients": args.clients,
        "doc_tokens": args.doc_tokens, "documents": args.documents, "mix": MIX, "series": rec.samples,
    }
    run["ok"] = (run["http_5xx"] == 0 and not run["unexpected"] and healthy
                 and all(not any(c["leaks"].values()) and c["all_free_after_flush"] for c in rec.checkpoints))
    progress(f"soak: attention={attention} {'PASSED' if run['ok'] else 'FAILED'}: {run['requests']} requests "
             f"in {run['duration_s']:.0f} s, 5xx {run['http_5xx']}, unexpected {run['unexpected']}, "
             f"leaks {run['leaks']} ({len(rec.checkpoints)} checks), "
             f"p50 {_fmt(run['latency']['all']['p50_s'])} p99 {_fmt(run['latency']['all']['p99_s'])}, "
             f"rss {run['rss_mb']['start']:.0f} -> {run['rss_mb']['end']:.0f} MB")
    return run


def plot(runs: list[dict], path: str) -> None:
    """RSS, KV pages in use (with the checkpoints) and request latency (p50 / p99 per sample
    window) over time, per mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rss, pages, lat) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for run in runs:
        series, name = run["series"], run["attention"]
        minutes = [s["t_s"] / 60 for s in series]
        line, = rss.plot(minutes, [s["rss_mb"] for s in series], label=name)
        pages.plot(minutes, [s["total_pages"] - s["free_pages"] for s in series], color=line.get_color(),
                   label=f"{name}: pages not free")
        pages.plot(minutes, [s["running_request_pages"] for s in series], color=line.get_color(),
                   linestyle=":", label=f"{name}: held by running requests")
        for check in run["checkpoints"]:  # pools checked and flushed here
            pages.axvline(check["t_s"] / 60, color=line.get_color(), alpha=0.3, linewidth=0.8)
        timed = [(m, s) for m, s in zip(minutes, series) if s["window_p50_s"] is not None]
        lat.plot([m for m, _ in timed], [s["window_p50_s"] for _, s in timed], color=line.get_color(),
                 label=f"{name} p50")
        lat.plot([m for m, _ in timed], [s["window_p99_s"] for _, s in timed], color=line.get_color(),
                 linestyle="--", label=f"{name} p99")
    rss.set_ylabel("server RSS (MB)")
    pages.set_ylabel("KV pages (| checkpoint: check, flush)")
    lat.set_ylabel("request latency (s)")
    lat.set_xlabel("minutes")
    for ax in (rss, pages, lat):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("soak: " + ", ".join(f"{r['attention']} {r['requests']} requests, {r['http_5xx']} 5xx, "
                                      f"{sum(r['leaks'].values())} leaked" for r in runs))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0, help="length of each run (default: %(default)s)")
    ap.add_argument("--attention", choices=("full", "shadowkv", "both"), default="both",
                    help="attention mode of the server; both: one run each, one after the other")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default: %(default)s)")
    ap.add_argument("--documents", type=int, default=3, help="long shared documents (default: %(default)s)")
    ap.add_argument("--doc-tokens", type=int, default=1536,
                    help="tokens per document, above --shadowkv-min-context (default: %(default)s)")
    ap.add_argument("--shadowkv-min-context", type=int, default=1024,
                    help="the ShadowKV server's compression threshold; the server's default (4096) "
                         "makes every document a long CPU prefill (default: %(default)s)")
    ap.add_argument("--shadowkv-compress-policy", choices=("eager", "tier"), default="eager",
                    help="eager (the default here) compresses every document at its prefill, so the soak "
                         "churns compressed state; the server's own default, tier, would keep these few "
                         "documents dense (default: %(default)s)")
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--server-threads", type=int, default=1,
                    help="torch CPU threads of the server (OMP_NUM_THREADS): on a small machine "
                         "shared with the clients, more threads wait on one another (a CPU decode "
                         "step measured 5x slower on 2 threads of 2 busy cores) (default: %(default)s)")
    ap.add_argument("--sample-s", type=float, default=15.0,
                    help="seconds between samples of pools, RSS and latency (default: %(default)s)")
    ap.add_argument("--checkpoint-s", type=float, default=300.0,
                    help="seconds between checkpoints: the clients pause, the idle server's pools are "
                         "checked for leaks and flushed (the final check comes on top) (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results", "soak_cpu.json"),
                    help="JSON path; the plot goes beside it with .png (default: %(default)s)")
    args = ap.parse_args(argv)
    if args.attention != "full" and args.doc_tokens <= args.shadowkv_min_context:
        ap.error("--doc-tokens must exceed --shadowkv-min-context, or ShadowKV compresses nothing")
    return args


def main() -> None:
    args = parse_args()
    modes = ["full", "shadowkv"] if args.attention == "both" else [args.attention]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    runs = []
    for mode in modes:
        runs.append(run_soak(mode, args, progress=lambda line: print(line, flush=True)))
        with open(args.out, "w") as f:  # after each run, so a finished run survives a later failure
            json.dump({"benchmark": "soak", "argv": sys.argv[1:], "runs": runs}, f, indent=1)
        plot(runs, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out} and its .png")
    sys.exit(0 if all(run["ok"] for run in runs) else 1)


if __name__ == "__main__":
    main()
