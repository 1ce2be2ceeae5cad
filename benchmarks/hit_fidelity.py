"""ShadowKV's two ways into a compressed document, against each other and against full attention
(issue: a question on a cached compressed document answered worse than the same question cold).

Per prompt, greedy, three answers:
- `full`: full attention (the reference);
- `cold`: ShadowKV on an empty cache, the whole prompt in one request: an exact dense prefill of
  document and question, the prompt compressed at its prefill, sparse decode;
- `hit`: ShadowKV with the document cached compressed by an earlier request: the question's own
  prefill attends the compressed document (its keys rebuilt from the low-rank factors, through a
  chunk selection: shadowkv/suffix_prefill.py), then sparse decode.
Each ShadowKV request's path is checked by the engine's counters (`compressed_prefix_hits`:
+1 on a hit, 0 on a cold request, `compressions` +1 on a cold one) and recorded. Prompts:
- `memo`: the 12 look-alike facts of benchmarks/memo_retrieval.py (5.2K tokens); the hit path
  caches the memo once, then every question hits it (as suffix_fidelity.py did);
- `niah`: NIAH prompts (sglang_shadowkv/testing/haystack.py, forms x lengths x depths); the
  earlier request is the prompt's document (everything before the question), or with
  `--niah-hit repeat` the whole prompt itself (the same request asked twice);
- `multiturn`: chats of benchmarks/multi_turn_niah.py, built on full attention's answers so that
  all three see the same prompts; the hit path runs the chat on one engine (turn 1 is cold, later
  turns hit what the earlier ones cached), cold and full answer each turn's prompt alone.
ShadowKV runs with compression forced (`--shadowkv-compress-policy eager` unless given) and every
other setting at its default unless given as a flag (sglang_shadowkv/testing/engine_flags.py).
Token agreement: equal tokens at equal positions over the longer answer of the two.

    python benchmarks/hit_fidelity.py                                # CPU, embedded SmolLM2
    python benchmarks/hit_fidelity.py --tasks memo --shadowkv-rank-energy 0.9999
    python benchmarks/hit_fidelity.py --tasks niah --niah-hit repeat --max-new-tokens 16

Writes JSON (every answer, its path and counters, summaries per task), prints a table.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from sglang_shadowkv import Engine
from sglang_shadowkv.testing.engine_flags import add_engine_flags, engine_kwargs, engine_overrides, save_result
from sglang_shadowkv.testing.haystack import INTRO, chat_turn, grid_needles, niah_prompt
from sglang_shadowkv.testing.prompts import make_chat, memo_prompts

TASKS = ("memo", "niah", "multiturn")
PATHS = ("full", "cold", "hit")


# ---- one ShadowKV request, its path checked ---------------------------------------------------
def _counters(engine: Engine) -> dict:
    skv = engine.get_server_info()["shadowkv"]
    return {k: skv[k] for k in ("compressions", "compressed_prefix_hits", "exact_copy_hits", "dense_copy_prefills")}


def generate_checked(engine: Engine, ids: list[int], params: dict, path: str | None) -> dict:
    """Generate; for a ShadowKV engine check that the request took `path` (cold: no compressed
    prefix matched, its prompt compressed; hit: a compressed prefix matched) and record it."""
    before = _counters(engine) if path else None
    out = engine.generate(input_ids=ids, sampling_params=params)
    if path:
        after = _counters(engine)
        delta = {k: after[k] - before[k] for k in after}
        took = "hit" if delta["compressed_prefix_hits"] else "cold" if delta["compressions"] else "dense"
        if took != path:
            raise RuntimeError(f"request meant for the {path} path took the {took} path ({delta})")
        out["path"], out["counters"] = took, delta
        out["ranks"] = (out["meta_info"].get("shadowkv") or {}).get("ranks")
    return out


def cache_document(engine: Engine, doc: list[int]) -> None:
    """An earlier request that leaves `doc` in the radix cache, compressed at its prefill."""
    before = _counters(engine)
    engine.generate(input_ids=doc, sampling_params={"max_new_tokens": 0})
    if _counters(engine)["compressions"] == before["compressions"]:
        raise RuntimeError("the document request compressed nothing (is it shorter than shadowkv_min_context?)")


# ---- prompts --------------------------------------------------------------------------------
def question_prefix(engine: Engine, ids: list[int], question: str) -> list[int]:
    """The prompt's tokens before its question: the document an earlier request caches."""
    text = engine.tokenizer.decode(ids)
    head = engine.tokenizer.encode(text[:text.rindex(question)], add_special_tokens=False)
    return os.path.commonprefix([ids, head])


def memo_cases(engine: Engine, args) -> list[dict]:
    prompts, needles = memo_prompts(engine, args.memo_tokens, args.facts, args.seed)
    doc = os.path.commonprefix(prompts)
    return [{"task": "memo", "group": "memo", "name": f"memo/{n.value}", "needle": n, "ids": ids, "doc": doc}
            for n, ids in zip(needles, prompts)]


def niah_cases(engine: Engine, args) -> list[dict]:
    cases = []
    for form in args.niah_forms:
        for length in args.niah_lengths:
            for depth in args.niah_depths:
                rng = random.Random(f"{args.seed}/{form}/{length}/{depth}/0")  # niah.py's seeds
                needle, hidden = grid_needles(form, depth, rng)
                ids = niah_prompt(engine, length, depth, needle, hidden)
                doc = ids if args.niah_hit == "repeat" else question_prefix(engine, ids, needle.question)
                name = f"niah/{form}/{length}/{depth}"
                cases.append({"task": "niah", "group": name, "name": name, "needle": needle, "ids": ids, "doc": doc})
    return cases


def multiturn_chats(engine: Engine, args) -> list[dict]:
    return [make_chat(engine.tokenizer, args.doc_tokens, args.turns, s) for s in range(args.chats)]


def multiturn_cases(full: Engine, chats: list[dict], params: dict) -> tuple[list[dict], dict]:
    """Each chat's turns on full attention (whose answers build the next turn's prompt, for all):
    the cases and full attention's answers to them."""
    cases, answers = [], {}
    for chat in chats:
        messages = []
        for turn, (depth, needle) in enumerate(chat["asked"], 1):
            content = f"{INTRO}\n\n{chat['doc']}\n\n{needle.question}" if turn == 1 else needle.question
            messages.append({"role": "user", "content": content})
            ids = chat_turn(full, messages, needle.answer_prefix)
            out = full.generate(input_ids=ids, sampling_params=params)
            messages.append({"role": "assistant", "content": needle.answer_prefix + out["text"]})
            name = f"multiturn/{chat['seed']}/turn{turn}"
            cases.append({"task": "multiturn", "group": f"multiturn/{chat['seed']}", "turn": turn, "name": name,
                          "needle": needle, "ids": ids, "doc": None})
            answers[name] = out
        full.flush_cache()
    return cases, answers


# ---- the three paths ------------------------------------------------------------------------
def run_full(engine: Engine, cases: list[dict], params: dict, done: dict) -> dict:
    out = {}
    for c in cases:
        if c["name"] not in done:
            out[c["name"]] = generate_checked(engine, c["ids"], params, None)
            engine.flush_cache()
    return {**done, **out}


def run_cold(engine: Engine, cases: list[dict], params: dict) -> dict:
    out = {}
    for c in cases:
        engine.flush_cache()
        out[c["name"]] = generate_checked(engine, c["ids"], params, "cold")
    engine.flush_cache()
    return out


def run_hit(engine: Engine, cases: list[dict], params: dict) -> dict:
    """Per group (one memo, one NIAH prompt, one chat) on a flushed cache: the document cached by
    an earlier request, then each prompt in order (a chat's turn 1 has nothing cached: cold)."""
    out = {}
    groups: dict[str, list[dict]] = {}
    for c in cases:
        groups.setdefault(c["group"], []).append(c)
    for members in groups.values():
        engine.flush_cache()
        if members[0]["doc"] is not None:
            cache_document(engine, members[0]["doc"])
        for c in members:
            path = "cold" if c["task"] == "multiturn" and c["turn"] == 1 else "hit"
            out[c["name"]] = generate_checked(engine, c["ids"], params, path)
    engine.flush_cache()
    return out


# ---- comparison -----------------------------------------------------------------------------
def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
    total = sum(max(len(p), len(q)) for p, q in zip(a, b))
    return {"token_agreement": same / max(total, 1), "tokens": total,
            "first_token": sum(p[:1] == q[:1] for p, q in zip(a, b)), "same_answers": sum(p == q for p, q in zip(a, b))}


def summarize(rows: list[dict]) -> dict:
    ids = {p: [r[p]["output_ids"] for r in rows] for p in PATHS}
    return {"prompts": len(rows), "correct": {p: sum(r[p]["correct"] for r in rows) for p in PATHS},
            "hit_vs_cold": agreement(ids["hit"], ids["cold"]), "hit_vs_full": agreement(ids["hit"], ids["full"]),
            "cold_vs_full": agreement(ids["cold"], ids["full"]),
            "paths": {p: sum(r["hit_path"] == p for r in rows) for p in ("hit", "cold")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    ap.add_argument("--memo-tokens", type=int, default=5000, help="memo tokens (the prompts: ~5.2K)")
    ap.add_argument("--facts", type=int, default=12, help="memo questions, one per fact")
    ap.add_argument("--niah-forms", nargs="+", default=["kv", "multikv"])
    ap.add_argument("--niah-lengths", nargs="+", type=int, default=[4608, 6144])
    ap.add_argument("--niah-depths", nargs="+", type=float, default=[0.1, 0.5, 0.9, 1.0])
    ap.add_argument("--niah-hit", choices=("document", "repeat"), default="document",
                    help="the earlier request: the prompt's document, or the whole prompt (asked twice)")
    ap.add_argument("--doc-tokens", type=int, default=5000, help="multi-turn document tokens")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--chats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--ignore-eos", action="store_true", help="generate max-new-tokens past the answer's end")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--skip-full", action="store_true", help="no full-attention answers (memo and NIAH only)")
    ap.add_argument("--out", default="benchmarks/results/hit_fidelity.json")
    args = ap.parse_args()
    overrides = engine_overrides(args)
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": args.ignore_eos}
    common = engine_kwargs(args, 4 * max(args.memo_tokens, args.doc_tokens, *args.niah_lengths))
    t0 = time.perf_counter()

    full = Engine(attention="full", **common)
    try:
        cases = (memo_cases(full, args) if "memo" in args.tasks else []) + \
                (niah_cases(full, args) if "niah" in args.tasks else [])
        answers = {}
        if "multiturn" in args.tasks:
            mt_cases, answers = multiturn_cases(full, multiturn_chats(full, args), params)
            cases += mt_cases
        if not args.skip_full:
            answers = run_full(full, cases, params, answers)
    finally:
        full.shutdown()
    shadow = Engine(attention="shadowkv", **common, **overrides)
    try:
        cold = run_cold(shadow, cases, params)
        hit = run_hit(shadow, cases, params)
        info = shadow.get_server_info()
    finally:
        shadow.shutdown()

    rows = []
    for c in cases:
        row = {"task": c["task"], "name": c["name"], "value": c["needle"].value, "prompt_tokens": len(c["ids"]),
               "doc_tokens": None if c["doc"] is None else len(c["doc"]), "turn": c.get("turn"),
               "hit_path": hit[c["name"]]["path"]}
        for p, outs in (("full", answers), ("cold", cold), ("hit", hit)):
            o = outs.get(c["name"]) or {"text": "", "output_ids": []}
            row[p] = {"text": o["text"], "output_ids": o["output_ids"], "correct": c["needle"].found_in(o["text"]),
                      "ranks": o.get("ranks")}
        rows.append(row)
    tasks = {t: summarize([r for r in rows if r["task"] == t]) for t in args.tasks}
    gate = [r for r in rows if r["task"] in ("memo", "niah")]
    overall = summarize(gate) if gate else None
    result = save_result(args.out, info, overrides, max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos,
                         niah_hit=args.niah_hit, seconds=round(time.perf_counter() - t0, 1), tasks=tasks,
                         memo_and_niah=overall, counters=_counters_all(info),
                         cuda_graph=info["steps"]["cuda_graph"], rows=rows)
    print_table(result, args)


def _counters_all(info: dict) -> dict:
    return {k: v for k, v in info["shadowkv"].items() if isinstance(v, int)}


def print_table(result: dict, args) -> None:
    print(f"\n{'prompt':<26} {'path':>4} {'full':>16} {'cold':>16} {'hit':>16}")
    for r in result["rows"]:
        cells = [f"{'+' if r[p]['correct'] else '-'}{r[p]['text'][:14]!r}" for p in PATHS]
        print(f"{r['name'][:26]:<26} {r['hit_path']:>4} " + " ".join(f"{c:>16}" for c in cells))
    print(f"\nShadowKV {result['engine_overrides']}; ranks of the last compression per layer: "
          f"{result['rows'][-1]['hit']['ranks']}")
    print(f"{'task':<10} {'n':>3} {'right full/cold/hit':>20} {'hit=cold tokens':>16} {'first':>6} "
          f"{'hit=full':>9} {'cold=full':>10}")
    for name, s in [*result["tasks"].items(), *([("memo+niah", result["memo_and_niah"])]
                                                  if result["memo_and_niah"] else [])]:
        c = s["correct"]
        print(f"{name:<10} {s['prompts']:>3} {c['full']:>8}/{c['cold']}/{c['hit']:<9} "
              f"{s['hit_vs_cold']['token_agreement']:>16.3f} {s['hit_vs_cold']['first_token']:>6} "
              f"{s['hit_vs_full']['token_agreement']:>9.3f} {s['cold_vs_full']['token_agreement']:>10.3f}")
    print(f"{result['seconds']} s")


if __name__ == "__main__":
    main()
