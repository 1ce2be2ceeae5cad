"""Time to first token of one document, cold and on a cache hit, full attention against ShadowKV's
compressed path, through the Engine at default flags (ShadowKV with compression forced).

Per context L (tokens of a random document; at the context length, what leaves room for the question) and attention mode, on a fresh Engine
after one untimed round on a 4K document of its own (WARMUP_TOKENS):
- `cold`: the document plus a 64-token question, one token out, on an empty cache (full: its dense
  prefill; ShadowKV: the same prefill plus the compression of the document);
- `hit`: another question on the cached document (full: a dense prefix hit; ShadowKV: a hit on
  the compressed document, its sparse suffix prefill);
- `hit_x16`: 16 questions at once on it, until the last first token;
- `cold_beside_decodes`: another cold document (and question) sent while 8 questions on the cached
  one decode, until its first token: what a chat's first turns meet (ShadowKV compresses it in a
  step beside sparse decodes); the step clock's labels over it go into the JSON
  (`cold_beside_clock`), so the step that compresses reads apart from the others;
- `decode_x16`: 16 questions on the cached document decoding 64 tokens each: the device time of a
  decode step (full: dense graphs; ShadowKV: sparse decode graphs), per step from the step clock
  (`decode_x16_step_ms`);
- `decode_docs`: up to 32K, questions on --distinct-docs (default 8) other cached documents of the same length,
  one each, decoding together (`decode_docs_step_ms`): what a chat's decode step holds (every row
  its own document's landmarks, low-rank keys and values), where 16 questions on one document
  share theirs. With `--profile` it is profiled too (`decode_docs_profile`).
The first hit and the first 16 at once of a shape may capture a CUDA graph (on first use): they are
timed apart (`first_hit`, `first_hit_x16`); `hit` is the median of the next three, `hit_x16` the
median of the next three sets of 16 (new questions each time). A sparse decode batch first replays
its width's largest graph padded and gets a graph of its own size after ~2500 padding rows
(cuda_graph_runner.PAD_ROWS_BEFORE_CAPTURE): `decode_x16`'s timed steps hold that, as a server's do.
ShadowKV runs `--shadowkv-compress-policy eager`, so the document is compressed at its prefill
(at the default policy, `tier`, it would stay dense and be served as full attention serves it:
that path is full attention's). With `--profile`, torch.profiler then runs around another cold request
and 16 decoding questions (in both modes: `cold_profile_difference` lists the ops whose device time
differs most between them), and ShadowKV's hit, 16 hits at once, cold request and next turn beside
decodes (not the timed ones); the top ops by device and by host time go into the JSON: where the
time goes; and `host_syncs` counts, for ShadowKV's five, the places where the engine waited for the
device.
Each mode runs in its own process (one GPU's memory each), then the two are compared.

    python benchmarks/cold_and_hit.py --model-path random:llama-3.1-8b --tokenizer-path DIR --profile
    python benchmarks/cold_and_hit.py --contexts 1024 --model-path random:smollm2-135m   # CPU check
    python benchmarks/cold_and_hit.py ... --contexts 16384 --modes shadowkv --distinct-docs 40 --profile \
        --engine-arg shadowkv_disable_gpu_values=true   # a chat's decode step, values over PCIe

Writes --out (default $OUT/cold_and_hit.json or benchmarks/results/cold_and_hit.json) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings

QUESTION_TOKENS = 64
CONCURRENT_QUESTIONS = 16
BESIDE_DECODES = 8  # questions on the cached document decoding while a cold one arrives
TURN_TOKENS = 320  # a chat's next turn: a 256-token answer and a 64-token question
HIT_REPEATS = 3  # hits timed after the first (their median)
DISTINCT_DOCS = 8  # decode_docs' default: questions on this many different cached documents, one each
MAX_DISTINCT_CONTEXT = 32768  # ... at contexts up to this (full attention's pool holds them dense there)
COLD_PROFILE_OPS = 80  # ops listed for the profiled cold request: enough for both modes' tails to overlap
# Before the timed contexts, each Engine serves one untimed round on a document this long (or the
# shortest context): a cold request, a hit, 16 hits and their decodes. Without it the first context
# read slower and scattered between processes of the same code on the H100 (ShadowKV at 16K: a hit
# 24-32 ms, 16 hits 131-169 ms); its own shapes' first-use graph captures stay in first_hit.
WARMUP_TOKENS = 4096


def _tokens(rng, n: int, vocab: int) -> list[int]:
    return rng.integers(100, vocab - 100, n).tolist()


def _timed(engine, prompts: list[list[int]]) -> float:
    sync = _device_sync(engine)
    start = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "temperature": 0})
    sync()
    return time.perf_counter() - start


def _device_sync(engine):
    import torch

    cuda = engine.scheduler.runner.device.type == "cuda"
    return torch.cuda.synchronize if cuda else (lambda: None)


def _top_ops(prof, key: str, n: int = 20) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:n]
    return [{"op": e.key[:80], "ms": getattr(e, key) / 1e3, "calls": e.count} for e in rows]


def _warm_up(engine, tokens: int, vocab: int) -> None:
    """One untimed round (see WARMUP_TOKENS) on a document of its own; the cache is emptied after."""
    import numpy as np

    rng = np.random.default_rng(1)
    doc = _tokens(rng, tokens, vocab)
    questions = [doc + _tokens(rng, QUESTION_TOKENS, vocab) for _ in range(2 + CONCURRENT_QUESTIONS)]
    _timed(engine, questions[:1])
    _timed(engine, questions[1:2])
    _timed(engine, questions[2:])
    _decode_steps(engine, questions[2:], tokens=8)
    engine.flush_cache()


def _first_token_beside_decodes(engine, prompt: list[int], decoding_prompts: list[list[int]],
                                decode_tokens: int = 256) -> dict:
    """A prompt's time to first token while the decoding prompts decode (up to decode_tokens
    each: a decode advances one token per step, the prompt's chunks included, so a few hundred
    outlast a cold prefill, and their reservations leave the pool room for it): they are admitted
    first and have their first tokens before it arrives; they are aborted once it has its own.
    Returns the seconds and the step clock over them (by label)."""
    from sglang_shadowkv.sampling_params import SamplingParams
    from sglang_shadowkv.scheduler.counters import clock_since

    sched = engine.scheduler
    decoding = [sched.add_request(f"beside-{i}", p, SamplingParams(max_new_tokens=decode_tokens, ignore_eos=True))
                for i, p in enumerate(decoding_prompts)]
    while not all(r.first_token_time for r in decoding):
        sched.step()
    before = sched.step_clock.as_dict()
    late = sched.add_request("beside-late", prompt, SamplingParams(max_new_tokens=1))
    while late.first_token_time is None:
        sched.step()
    seconds = late.first_token_time - late.created
    clock = clock_since(before, sched.step_clock.as_dict())
    for r in decoding:
        sched.abort(r.rid)
    while sched.has_work:
        sched.step()
    return {"seconds": seconds, "clock": clock}


def _decode_steps(engine, prompts: list[list[int]], tokens: int = 64) -> dict:
    """The prompts decode `tokens` tokens each at once; the step clock's decode-only steps over them."""
    from sglang_shadowkv.scheduler.counters import clock_since

    sched = engine.scheduler
    before = sched.step_clock.as_dict()
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": tokens, "ignore_eos": True})
    decode = clock_since(before, sched.step_clock.as_dict()).get("decode_only", {"steps": 0, "ms": 0})
    # None when no step was decode-only (at 128K the 16 do not fit at once: a prompt chunk joins every step)
    return {"steps": decode["steps"], "step_ms": decode["ms"] / decode["steps"] if decode["steps"] else None}


def _distinct_docs_decode(engine, rng, length: int, vocab: int, count: int, profile: bool) -> dict:
    """`count` new documents of `length` tokens cached (prefilled, compressed with ShadowKV), then a
    new question on each decoding together: _decode_steps' step time (once untimed first: its
    graphs), and with `profile` a profiled round."""
    docs = [_tokens(rng, length, vocab) for _ in range(count)]
    questions = [_tokens(rng, QUESTION_TOKENS, vocab) for _ in range(1 + 2 * count)]
    engine.generate(input_ids=[d + questions[0] for d in docs], sampling_params={"max_new_tokens": 1})
    _decode_steps(engine, [d + q for d, q in zip(docs, questions[1:])], tokens=8)
    timed = [d + q for d, q in zip(docs, questions[1 + count:])]
    out = _decode_steps(engine, timed)
    if profile:  # the timed round again (as decode_x16_profile does)
        out["profile"] = _profiled(engine, lambda: _decode_steps(engine, timed), ops=40)
    return out


def _profiled(engine, run, ops: int = 20) -> dict:
    """The top `ops` ops by device and by host time while run() serves its requests."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.scheduler.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run()
        _device_sync(engine)()
    device_key = "self_device_time_total" if cuda else "self_cpu_time_total"
    return {"device_top": _top_ops(prof, device_key, ops), "host_top": _top_ops(prof, "self_cpu_time_total", ops)}


def _host_syncs(engine, run) -> dict[str, int]:
    """Where the engine waits for the device while run() serves its requests: torch's sync debug mode
    warns at every implicit synchronisation (.item(), .tolist(), a copy to pageable memory), and the
    innermost frame of this package at each warning is counted."""
    import torch

    if engine.scheduler.runner.device.type != "cuda":
        return {}
    package = os.path.join("sglang_shadowkv", "")
    sites: dict[str, int] = {}

    def record(*_args, **_kwargs):
        ours = [f for f in traceback.extract_stack() if package in f.filename]
        site = f"{ours[-1].filename.split(package)[-1]}:{ours[-1].lineno} {ours[-1].name}" if ours else "outside"
        sites[site] = sites.get(site, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(sorted(sites.items(), key=lambda kv: -kv[1]))


def run_mode(args) -> dict:
    """One attention mode on one fresh Engine: every context's cold, hit and hit_x16 times."""
    import numpy as np

    from sglang_shadowkv import Engine

    kwargs = {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path}
    if args.mode == "shadowkv":
        kwargs["shadowkv_compress_policy"] = "eager"
        kwargs.update(engine_args(args.engine_arg))
    with Engine(attention=args.mode, **{k: v for k, v in kwargs.items() if v is not None}) as engine:
        vocab = engine.scheduler.vocab_size
        longest = engine.scheduler.context_length - QUESTION_TOKENS - 1
        _warm_up(engine, min(WARMUP_TOKENS, *args.contexts, longest), vocab)
        rng = np.random.default_rng(0)
        rows = []
        for context in args.contexts:
            engine.flush_cache()
            doc = _tokens(rng, min(context, longest), vocab)
            questions = [_tokens(rng, QUESTION_TOKENS, vocab)
                         for _ in range(2 + HIT_REPEATS + (1 + HIT_REPEATS) * CONCURRENT_QUESTIONS)]
            cold = _timed(engine, [doc + questions[0]])
            # the first hit of a shape may capture its CUDA graph (on first use): timed apart
            first_hit = _timed(engine, [doc + questions[1]])
            hit = statistics.median(_timed(engine, [doc + q]) for q in questions[2:2 + HIT_REPEATS])
            first = 2 + HIT_REPEATS
            batches = [questions[first + i * CONCURRENT_QUESTIONS:first + (i + 1) * CONCURRENT_QUESTIONS]
                       for i in range(1 + HIT_REPEATS)]
            first_hit_x16 = _timed(engine, [doc + q for q in batches[0]])
            hit_x16 = statistics.median(_timed(engine, [doc + q for q in batch]) for batch in batches[1:])
            beside_prompts = [doc + q for q in batches[0][:BESIDE_DECODES]]

            def beside(tag: int):  # each time a document nobody sent before
                return _first_token_beside_decodes(engine, _tokens(rng, len(doc), vocab) + questions[tag],
                                                   beside_prompts)

            def turn_beside():  # each time a turn nobody sent before
                return _first_token_beside_decodes(engine, doc + _tokens(rng, TURN_TOKENS, vocab), beside_prompts)

            _decode_steps(engine, beside_prompts, tokens=8)  # captures the graphs of the decodes beside
            cold_beside = beside(0)
            turn = turn_beside()
            _decode_steps(engine, [doc + q for q in batches[0]], tokens=8)  # and of 16 decoding
            decode = _decode_steps(engine, [doc + q for q in batches[1]])
            docs_decode = _distinct_docs_decode(engine, rng, len(doc), vocab, args.distinct_docs, args.profile) \
                if context <= MAX_DISTINCT_CONTEXT else {"step_ms": None, "steps": 0}
            info = engine.get_server_info()
            graphs = info["steps"].get("cuda_graph") or {}
            row = {"context": context, "cold_s": cold, "hit_s": hit, "hit_x16_s": hit_x16,
                   "first_hit_s": first_hit, "first_hit_x16_s": first_hit_x16,
                   "cold_beside_decodes_s": cold_beside["seconds"], "cold_beside_clock": cold_beside["clock"],
                   "turn_beside_decodes_s": turn["seconds"], "turn_beside_clock": turn["clock"],
                   "decode_x16_step_ms": decode["step_ms"], "decode_x16_steps": decode["steps"],
                   "decode_docs_step_ms": docs_decode["step_ms"], "decode_docs_steps": docs_decode["steps"],
                   **({"decode_docs_profile": docs_decode["profile"]} if "profile" in docs_decode else {}),
                   "compressed_prefix_hits": info["stats"].get("compressed_prefix_hits"),
                   "graph_replays_by_variant": graphs.get("replays_by_variant"),
                   "graph_capture_seconds": graphs.get("capture_seconds"), "graph_bytes": graphs.get("graph_bytes")}
            if args.profile:  # again, profiled (the timings above are not); the cold request in both modes
                row["decode_x16_profile"] = _profiled(
                    engine, lambda: _decode_steps(engine, [doc + q for q in batches[1]]), ops=40)
                engine.flush_cache()
                row["profile"] = {"cold": _profiled(engine, lambda: _timed(engine, [doc + questions[0]]),
                                                    ops=COLD_PROFILE_OPS)}
            if args.profile and args.mode == "shadowkv":
                row["profile"].update({
                    "hit": _profiled(engine, lambda: _timed(engine, [doc + questions[2]])),
                    "hit_x16": _profiled(engine, lambda: _timed(engine, [doc + q for q in batches[1]])),
                    "cold_beside": _profiled(engine, lambda: beside(1)),
                    "turn_beside": _profiled(engine, turn_beside, ops=40),
                    "host_syncs": {
                        "hit": _host_syncs(engine, lambda: _timed(engine, [doc + questions[3]])),
                        "hit_x16": _host_syncs(engine, lambda: _timed(engine, [doc + q for q in batches[0]])),
                        "cold_beside": _host_syncs(engine, lambda: beside(2)),
                        "turn_beside": _host_syncs(engine, turn_beside)}})
                engine.flush_cache()
                row["profile"]["host_syncs"]["cold"] = _host_syncs(engine, lambda: _timed(engine, [doc + questions[0]]))
            rows.append(row)
            print(f"[{args.mode}] {context:>7}: cold {cold:.3f} s, hit {hit * 1e3:.1f} ms (first {first_hit * 1e3:.0f}), "
                  f"16 hits {hit_x16 * 1e3:.1f} ms (first {first_hit_x16 * 1e3:.0f}), "
                  f"cold beside {BESIDE_DECODES} decodes {cold_beside['seconds']:.3f} s, "
                  f"next turn beside them {turn['seconds'] * 1e3:.0f} ms, "
                  f"decode step of 16 {decode['step_ms'] or 0:.1f} ms, "
                  f"of {args.distinct_docs} documents {docs_decode['step_ms'] or 0:.1f} ms", flush=True)
        info = engine.get_server_info()
        return {"mode": args.mode, "device": info.get("device"), "rows": rows}


def engine_args(pairs: list[str]) -> dict:
    """--engine-arg KEY=VALUE pairs as Engine keywords (VALUE read as JSON, else as text)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-arg takes KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _row_pairs(modes: dict) -> list[tuple[dict, dict]]:
    """Full attention's and ShadowKV's rows, context by context (none unless both modes ran)."""
    full, skv = modes.get("full"), modes.get("shadowkv")
    return list(zip(full["rows"], skv["rows"])) if full and skv else []


def compare(modes: dict) -> list[dict]:
    """ShadowKV's time over full attention's, per context and measure (lower is better)."""
    out = []
    for f, s in _row_pairs(modes):
        out.append({"context": f["context"], **{k.rsplit("_", 1)[0]: s[k] / f[k] if s[k] and f[k] else None
                                                for k in ("cold_s", "hit_s", "hit_x16_s", "first_hit_s",
                                                          "cold_beside_decodes_s", "turn_beside_decodes_s",
                                                          "decode_x16_step_ms",
                                                          "decode_docs_step_ms")}})
    return out


def cold_profile_difference(modes: dict, top: int = 25) -> list[dict]:
    """Per context, the ops whose device time in the profiled cold request differs most between
    the modes (ShadowKV's ms minus full attention's; an op outside a mode's listed top counts 0
    there): where a cold document's extra time goes (compression, its copies, its planning)."""
    out = []
    for f, s in _row_pairs(modes):
        if "profile" not in f or "profile" not in s:
            continue
        ms = [_ms_by_name(row["profile"]["cold"]["device_top"]) for row in (f, s)]
        ops = sorted(set(ms[0]) | set(ms[1]), key=lambda op: -abs(ms[1].get(op, 0.0) - ms[0].get(op, 0.0)))
        out.append({"context": f["context"], "ops": [
            {"op": op, "extra_ms": ms[1].get(op, 0.0) - ms[0].get(op, 0.0), "shadowkv_ms": ms[1].get(op, 0.0),
             "full_ms": ms[0].get(op, 0.0)} for op in ops[:top]]})
    return out


def _ms_by_name(entries: list[dict]) -> dict[str, float]:
    """Device ms per listed name, summed: kernel names are cut to 80 characters, so different
    kernels can share one (compared one against the other, their differences were fictions)."""
    ms: dict[str, float] = {}
    for e in entries:
        ms[e["op"]] = ms.get(e["op"], 0.0) + e["ms"]
    return ms


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 131072])
    ap.add_argument("--modes", nargs="+", default=["full", "shadowkv"], choices=["full", "shadowkv"])
    ap.add_argument("--profile", action="store_true",
                    help="torch.profiler around the cold request (both modes: cold_profile_difference compares "
                         "them), and ShadowKV's hit, 16 hits and cold request beside decodes")
    ap.add_argument("--distinct-docs", type=int, default=DISTINCT_DOCS,
                    help="decode_docs: questions on this many different cached documents decode together")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="an Engine keyword for the ShadowKV engine, e.g. shadowkv_disable_gpu_values=true")
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # internal: run one mode in this process
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.mode:
        print("RESULT " + json.dumps(run_mode(args)), flush=True)
        return {}
    out = args.out or os.path.join(os.environ.get("OUT", os.path.join("benchmarks", "results")), "cold_and_hit.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    modes = {}
    for mode in args.modes:  # one process per mode: each gets the whole GPU
        cmd = [sys.executable, __file__, "--mode", mode, "--contexts", *map(str, args.contexts)]
        cmd += [f"--{k}={v}" for k, v in (("model-path", args.model_path), ("tokenizer-path", args.tokenizer_path))
                if v is not None] + (["--profile"] if args.profile else []) + [f"--engine-arg={a}" for a in args.engine_arg]
        cmd += [f"--distinct-docs={args.distinct_docs}"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        sys.stdout.write("".join(line + "\n" for line in run.stdout.splitlines() if not line.startswith("RESULT ")))
        result = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
        if run.returncode != 0 or not result:
            raise SystemExit(f"{mode} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
        modes[mode] = json.loads(result[-1][len("RESULT "):])
        report = {"model_path": args.model_path or "embedded", "question_tokens": QUESTION_TOKENS,
                  "shadowkv_engine_args": engine_args(args.engine_arg),
                  "modes": modes, "shadowkv_over_full": compare(modes)}
        if args.profile:
            report["cold_profile_difference"] = cold_profile_difference(modes)
        with open(out, "w") as f:  # after each mode: a run cut short keeps what it measured
            json.dump(report, f, indent=1)
    print(f"{'context':>8} | ShadowKV / full: cold | hit | 16 hits | cold beside decodes | next turn beside them | "
          f"decode step of 16 | of {args.distinct_docs} documents")
    for r in report["shadowkv_over_full"]:
        print(" | ".join([f"{r['context']:>8}"] + [f"{r[k]:.2f}" if r[k] else "-" for k in
                                                   ("cold", "hit", "hit_x16", "cold_beside_decodes", "turn_beside_decodes",
                                                    "decode_x16_step",
                                                    "decode_docs_step")]))
    return report


if __name__ == "__main__":
    main()
