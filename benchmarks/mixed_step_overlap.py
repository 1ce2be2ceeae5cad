"""A ShadowKV mixed step's graph parts beside its eager part (model_runner._forward_parts): the same
tokens as one after the other, and what it saves, through the Engine.

A chat's first-turn phase is made of mixed steps: a cold document's prompt chunk (eager, the
prefill GEMMs) and the decodes of the sessions already answering over compressed documents (a
decode graph). By default the graphs replay on a high-priority side stream beside the prompt
chunk; `--disable-mixed-step-overlap` runs them one after the other. This drives the same steps
both ways on one Engine (ShadowKV, compression at prefill), alternating rounds:
- a document of --context tokens compressed and cached, then --decodes questions on it decoding,
- a cold document of the same length and one more question on the cached one sent beside them,
- every request run to its end, stepped one step at a time (the same step sequence each round).
It reports each round's output tokens (all rounds must agree: the two sides share no buffer), the
cold document's time to its first token, the mixed steps' device time from the step clock, and
how many steps ran in parts.

    python benchmarks/mixed_step_overlap.py --model-path random:llama-3.1-8b --tokenizer-path DIR
    python benchmarks/mixed_step_overlap.py --model-path random:smollm2-135m --context 1024  # CPU check

Writes --out (default $OUT/mixed_step_overlap.json or benchmarks/results/mixed_step_overlap.json).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages
from benchmarks.cold_and_hit import QUESTION_TOKENS, _tokens  # noqa: E402  (its random documents and questions)


def one_round(engine, doc: list[int], cold_doc: list[int], questions: list[list[int]], decode_tokens: int) -> dict:
    """The scenario above on an empty cache; outputs by request, the cold document's TTFT and the
    step clock over the mixed steps."""
    from sglang_shadowkv.sampling_params import SamplingParams
    from sglang_shadowkv.scheduler.counters import clock_since

    engine.flush_cache()
    sched, runner = engine.scheduler, engine.scheduler.runner
    engine.generate(input_ids=[doc + questions[0]], sampling_params={"max_new_tokens": 1})  # compressed, cached
    params = SamplingParams(max_new_tokens=decode_tokens, temperature=0, ignore_eos=True)
    decoding = [sched.add_request(f"q{i}", doc + q, params) for i, q in enumerate(questions[2:])]
    while not all(r.first_token_time for r in decoding):
        sched.step()
    before = sched.step_clock.as_dict()
    late = [sched.add_request("cold", cold_doc + questions[1], params),
            sched.add_request("hit", doc + questions[1], params)]
    parts_steps = 0
    while sched.has_work:
        replays, eager = runner.graphs.replays if runner.graphs else 0, runner.eager_steps
        sched.step()
        if runner.graphs and runner.graphs.replays > replays and runner.eager_steps > eager:
            parts_steps += 1
    cold = late[0]
    return {"outputs": {r.rid: r.output_ids for r in decoding + late},
            "cold_ttft_s": cold.first_token_time - cold.created,
            "clock": clock_since(before, sched.step_clock.as_dict()), "parts_steps": parts_steps}


def first_difference(a: dict[str, list[int]], b: dict[str, list[int]]) -> dict[str, int]:
    """Per request whose tokens differ: the first position where they do."""
    return {rid: next(i for i, (x, y) in enumerate(itertools.zip_longest(a[rid], b[rid])) if x != y)
            for rid in a if a[rid] != b[rid]}


def main(argv: list[str] | None = None) -> dict:
    import numpy as np

    from sglang_shadowkv import Engine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M")
    ap.add_argument("--tokenizer-path", default=None)
    ap.add_argument("--context", type=int, default=16384, help="tokens of each document")
    ap.add_argument("--decodes", type=int, default=8, help="questions decoding beside the cold document")
    ap.add_argument("--decode-tokens", type=int, default=64, help="tokens each request decodes")
    ap.add_argument("--rounds", type=int, default=4, help="rounds, overlap on and off alternating (on first)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = args.out or os.path.join(os.environ.get("OUT", os.path.join("benchmarks", "results")),
                                   "mixed_step_overlap.json")
    kwargs = {"model_path": args.model_path, "tokenizer_path": args.tokenizer_path}
    with Engine(attention="shadowkv", shadowkv_compress_policy="eager",
                **{k: v for k, v in kwargs.items() if v is not None}) as engine:
        runner = engine.scheduler.runner
        side_stream = runner.parts_stream  # None on a CPU: both settings then run the same path
        vocab = engine.scheduler.vocab_size
        rng = np.random.default_rng(0)
        doc, cold_doc = _tokens(rng, args.context, vocab), _tokens(rng, args.context, vocab)
        questions = [_tokens(rng, QUESTION_TOKENS, vocab) for _ in range(2 + args.decodes)]
        # untimed, the same round: compiles and captures what the rounds need (a decode batch replays a
        # larger graph padded until its own is captured, whose GEMM shapes round differently)
        one_round(engine, doc, cold_doc, questions, args.decode_tokens)
        rounds = []
        for i in range(args.rounds):
            overlap = i % 2 == 0
            runner.parts_stream = side_stream if overlap else None
            start = time.perf_counter()
            r = one_round(engine, doc, cold_doc, questions, args.decode_tokens)
            r.update(overlap=overlap, seconds=time.perf_counter() - start,
                     graph_captures=len(runner.graphs.capture_log) if runner.graphs else 0)
            rounds.append(r)
            mixed = {k: v for k, v in r["clock"].items() if "+" in k}
            print(f"round {i} overlap={r['overlap']}: cold TTFT {r['cold_ttft_s']:.3f} s, {r['parts_steps']} steps in "
                  f"parts, mixed steps' device ms {sum(v.get('device_ms', 0) for v in mixed.values()):.0f}", flush=True)
        runner.parts_stream = side_stream
        info = engine.get_server_info()
    first = rounds[0]["outputs"]
    for i, r in enumerate(rounds):  # where each request's tokens part from round 0's, and from the last round of its setting
        same_setting = next((o for o in reversed(rounds[:i]) if o["overlap"] == r["overlap"]), None)
        r["first_difference"] = {"from_round_0": first_difference(first, r["outputs"]),
                                 "from_same_setting": same_setting and first_difference(same_setting["outputs"], r["outputs"])}
    differ = sorted({rid for r in rounds for rid in r["first_difference"]["from_round_0"]})

    def median_of(overlap: bool, key: str):
        values = [r[key] for r in rounds if r["overlap"] == overlap]
        return statistics.median(values) if values else None

    report = {"device": info.get("device"), "model_path": args.model_path or "embedded", "context": args.context,
              "decodes": args.decodes, "decode_tokens": args.decode_tokens, "side_stream": side_stream is not None,
              "same_tokens": not differ, "requests_that_differ": differ,
              "cold_ttft_s": {"overlap": median_of(True, "cold_ttft_s"), "one_after_the_other": median_of(False, "cold_ttft_s")},
              "rounds": [{k: v for k, v in r.items() if k != "outputs"} for r in rounds]}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"same tokens in every round: {report['same_tokens']}; cold TTFT median, overlap "
          f"{report['cold_ttft_s']['overlap']:.3f} s, one after the other {report['cold_ttft_s']['one_after_the_other']:.3f} s")
    if differ:
        raise SystemExit(f"outputs differ between rounds: {differ}")
    return report


if __name__ == "__main__":
    main()
