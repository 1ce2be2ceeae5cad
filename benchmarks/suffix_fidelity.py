"""Sparse suffix prefill against the restore path, on the same compressed document (issue 21).

A question over a cached compressed document prefills only its suffix. By default the suffix
attends every compressed chunk (what a dense restore would compute); with
`--shadowkv-sparse-prefill-max N` it attends the chunks its queries select (per tile of 64 queries,
as decode does). The sparse path here sets N = SPARSE_PREFILL_MAX. Both engines
compress the memo of benchmarks/memo_retrieval.py once, then answer its questions greedily; this
compares their tokens position by position, the first answer token on its own, and whether the
document was compressed once and every question hit it.

    python benchmarks/suffix_fidelity.py                  # CPU, embedded SmolLM2, 5.2K-token memo
    python benchmarks/suffix_fidelity.py --max-new-tokens 32 --shadowkv-rank 96

Writes JSON, prints a table.
"""

from __future__ import annotations

import argparse
import os

from sglang_shadowkv import Engine
from sglang_shadowkv.testing.engine_flags import add_engine_flags, engine_kwargs, engine_overrides, save_result
from sglang_shadowkv.testing.prompts import memo_prompts

SPARSE_PREFILL_MAX = 2048  # every question of the memo is shorter
PATHS = {"sparse": {"shadowkv_sparse_prefill_max": SPARSE_PREFILL_MAX}, "exact": {"shadowkv_sparse_prefill_max": 0}}


def answer_over_cached_document(engine: Engine, prompts: list[list[int]], max_new_tokens: int,
                                stop_at_eos: bool) -> list[dict]:
    """Cache (and compress) the prompts' common prefix with a request of its own, so that every
    question is a suffix over it; then answer each greedily (past the end of the answer unless
    stop_at_eos: the memo's answers are a few tokens, the continuation tests the decode after them)."""
    shared = os.path.commonprefix(prompts)
    engine.generate(input_ids=shared, sampling_params={"max_new_tokens": 0})
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": not stop_at_eos}
    return [engine.generate(input_ids=ids, sampling_params=params) for ids in prompts]


def agreement(sparse: list[dict], exact: list[dict]) -> dict:
    same = sum(a == b for s, e in zip(sparse, exact) for a, b in zip(s["output_ids"], e["output_ids"]))
    total = sum(len(e["output_ids"]) for e in exact)
    return {"token_agreement": same / total, "tokens": total,
            "first_token_agreement": sum(s["output_ids"][:1] == e["output_ids"][:1] for s, e in zip(sparse, exact))
            / len(exact),
            "same_answers": sum(s["output_ids"] == e["output_ids"] for s, e in zip(sparse, exact))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap)
    ap.add_argument("--memo-tokens", type=int, default=5000, help="memo tokens (the prompts: ~5.2K)")
    ap.add_argument("--facts", type=int, default=12, help="questions, one per fact of the memo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="end each answer at its end-of-sequence token (default: generate max-new-tokens)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="benchmarks/results/suffix_fidelity.json")
    args = ap.parse_args()
    if args.shadowkv_sparse_prefill_max is not None:
        ap.error("--shadowkv-sparse-prefill-max is what this compares (2048 against 0); leave it unset")
    overrides = engine_overrides(args)
    outs, counters, info = {}, {}, None
    for path, setting in PATHS.items():
        engine = Engine(attention="shadowkv", **engine_kwargs(args, 4 * args.memo_tokens), **overrides, **setting)
        try:
            prompts, _ = memo_prompts(engine, args.memo_tokens, args.facts, args.seed)
            outs[path] = answer_over_cached_document(engine, prompts, args.max_new_tokens, args.stop_at_eos)
            info = engine.get_server_info()
            counters[path] = {k: info["shadowkv"][k] for k in ("compressions", "compressed_prefix_hits")}
        finally:
            engine.shutdown()
    summary = agreement(outs["sparse"], outs["exact"])
    result = save_result(args.out, info, overrides, prompt_tokens=len(prompts[0]), questions=len(prompts),
                         max_new_tokens=args.max_new_tokens, stop_at_eos=args.stop_at_eos, counters=counters, **summary,
                         answers=[{"sparse": s["text"], "exact": e["text"]} for s, e in zip(outs["sparse"], outs["exact"])])
    print(f"{'sparse suffix prefill':>36} {'exact (every chunk)':>36}")
    for row in result["answers"]:
        print(f"{row['sparse'][:34]!r:>36} {row['exact'][:34]!r:>36}")
    print(f"{result['prompt_tokens']}-token prompts, {len(prompts)} questions: token agreement "
          f"{summary['token_agreement']:.3f} of {summary['tokens']}, first token "
          f"{summary['first_token_agreement']:.3f}, same answers {summary['same_answers']}/{len(prompts)}; "
          f"counters {counters}")


if __name__ == "__main__":
    main()
