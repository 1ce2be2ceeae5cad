"""Many similar facts in one long memo: full attention against ShadowKV on the same prompts.

A memo (the NIAH haystack of sglang_shadowkv/testing/haystack.py) holds twelve facts of one shape,
"The access code for the <word> room is <4 digits>.", evenly spread; one chat question per fact,
answered greedily with the answer primed ("The access code for the <word> room is"). The questions
share the memo, so the radix cache holds it once per engine (ShadowKV: compressed once, every
question decodes sparsely over it). This is the task that showed ShadowKV changing answers at its
old defaults (issue 16): a look-alike fact is one wrong chunk away. (With stdlib prose around the
facts instead, the embedded model itself answers 2 of 12; with this filler, 5.)

    python benchmarks/memo_retrieval.py                        # CPU, embedded SmolLM2, 5.2K-token memo
    python benchmarks/memo_retrieval.py --shadowkv-rank 30     # any ShadowKV setting as a flag

Writes JSON (answers of both methods, how many are right, how many agree); prints a table.
"""

from __future__ import annotations

import argparse

from sglang_shadowkv import Engine
from sglang_shadowkv.testing.engine_flags import add_engine_flags, engine_kwargs, engine_overrides, save_result
from sglang_shadowkv.testing.haystack import WORDS, Needle
from sglang_shadowkv.testing.prompts import memo_prompts


def answer_all(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> list[dict]:
    """Greedy answers one question at a time (the memo stays in the radix cache between them)."""
    outs = [engine.generate(input_ids=ids, sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0})
            for ids in prompts]
    engine.flush_cache()
    return outs


def compare(full: list[dict], shadow: list[dict], needles: list[Needle]) -> dict:
    """Right answers of each method and how many ShadowKV answers equal full attention's."""
    rows = [{"value": n.value, "full": f["text"], "shadowkv": s["text"], "full_correct": n.found_in(f["text"]),
             "shadowkv_correct": n.found_in(s["text"]), "same_answer": f["output_ids"] == s["output_ids"],
             "shadowkv_info": {k: s["meta_info"]["shadowkv"].get(k) for k in ("compressed_tokens", "ranks", "budget")}}
            for n, f, s in zip(needles, full, shadow)]
    return {"full_correct": sum(r["full_correct"] for r in rows),
            "shadowkv_correct": sum(r["shadowkv_correct"] for r in rows),
            "same_answers": sum(r["same_answer"] for r in rows), "questions": len(rows), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap)
    ap.add_argument("--memo-tokens", type=int, default=5000, help="memo tokens (the prompts: ~5.2K)")
    ap.add_argument("--facts", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="benchmarks/results/memo_retrieval.json")
    args = ap.parse_args()
    if args.facts > len(WORDS):
        ap.error(f"--facts must be at most {len(WORDS)} (distinct words)")
    overrides = engine_overrides(args)
    common = engine_kwargs(args, 4 * args.memo_tokens)
    results, info = {}, None
    for method in ("full", "shadowkv"):
        engine = Engine(attention=method, **common, **(overrides if method == "shadowkv" else {}))
        try:
            prompts, needles = memo_prompts(engine, args.memo_tokens, args.facts, args.seed)
            results[method] = answer_all(engine, prompts, args.max_new_tokens)
            info = engine.get_server_info() if method == "shadowkv" else info
        finally:
            engine.shutdown()
    summary = compare(results["full"], results["shadowkv"], needles)
    result = save_result(args.out, info, overrides, prompt_tokens=len(prompts[0]), **summary)
    print(f"{'code':>6} {'full':>24} {'shadowkv':>24}")
    for r in summary["rows"]:
        print(f"{r['value']:>6} {r['full'][:22]!r:>24} {r['shadowkv'][:22]!r:>24}")
    print(f"{result['prompt_tokens']}-token prompts: full {summary['full_correct']}/{summary['questions']}, "
          f"ShadowKV {summary['shadowkv_correct']}/{summary['questions']}, "
          f"same answer {summary['same_answers']}/{summary['questions']}")


if __name__ == "__main__":
    main()
