"""RULER's synthetic tasks through the engine: full attention, ShadowKV cold and ShadowKV on a hit.

The tasks (sglang_shadowkv/testing/ruler.py, generated locally, no download): NIAH single 1-3,
multikey 1-3, multivalue and multiquery, variable tracking (vt), common-words (cwe) and
frequent-words (fwe) extraction, with RULER's templates and its string-match-all score (the share of
expected values in the answer), and `lookalike`: a memo of 12 facts of one template, one asked.
Each sample is answered greedily three ways (benchmarks/hit_fidelity.py's paths, each ShadowKV
request's path checked by the engine's counters):
- `full`: full attention;
- `cold`: ShadowKV on an empty cache: an exact dense prefill of the prompt, compressed at its
  prefill, sparse decode;
- `hit`: ShadowKV with the sample's document (the prompt before its question) cached compressed by
  an earlier request: the question's prefill attends the document's exact copy, loaded into dense
  pages (the dense kernel, as the cold prefill; each hit row records `from_copies` and
  `copy_loaded` from the counters), then sparse decode over the compressed document.
  The earlier request holds the document alone (--hit-after document, the default), or the
  document and another question (--hit-after question: OTHER_QUESTION, long enough that the
  document is compressed to its last chunk, as a chat's or an agent's next question finds it), or
  the whole prompt (--hit-after prompt, the same question asked again: the hit then holds the
  very compressed form the cold path made, and only its last tokens are prefilled again).
- `full_hit` (asked for by --paths): full attention with the sample's document in its radix cache,
  dense, from an earlier request. Nothing is approximated; only the prefill is split, so the sums
  run in another order. Its agreement with `full` is the floor of the token metric: how far an
  exact engine's long greedy answers part over rounding alone, at near ties of the model.
Per task: RULER's score of each path, and greedy token agreement hit against cold, cold against
full, full_hit against full (equal tokens at equal positions over the longer answer). ShadowKV runs at its defaults with
compression forced (--shadowkv-compress-policy eager, and --shadowkv-min-context 1024: a 4K sample's
document is shorter than the default 4096, unless given); any ShadowKV setting is a flag.

    python benchmarks/ruler.py                                       # CPU: every task, 4K and 8K, 12 samples
    python benchmarks/ruler.py --tasks niah_single_1 lookalike --lengths 4096 --samples 2 --out /tmp/ruler.json
    python benchmarks/ruler.py --paths hit --shadowkv-rank 192      # one path under another setting
    python benchmarks/ruler.py --table benchmarks/results/ruler_cpu.json   # the table of a result
    python benchmarks/ruler.py --merge a.json b.json --out all.json  # runs of the same settings, one file
    python benchmarks/ruler.py --merge old.json --paths full --out full.json   # a run's full answers alone
    python benchmarks/ruler.py --merge full.json cold_hit.json --out all.json  # joined to another run's
    python benchmarks/ruler.py --first-sample 6 --samples 6 ...      # a task's second half (merge joins halves)
    python benchmarks/ruler.py --compare a.json b.json --paths cold --out spread.json   # one path, two runs
    python benchmarks/ruler.py --compare hit.json full_cold.json --paths hit cold --out x.json   # a's hit, b's cold

Writes compact JSON (every answer's tokens, path and score; per task and length the summaries)
after every task, so a long run keeps what it has done; prints a table. `--merge` of one file
rewrites an older result in that form.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages
from benchmarks.hit_fidelity import agreement, cache_document, generate_checked, question_prefix  # noqa: E402
from sglang_shadowkv import Engine  # noqa: E402
from sglang_shadowkv.testing.engine_flags import (add_engine_flags, engine_kwargs, engine_overrides,  # noqa: E402
                                                  save_result)
from sglang_shadowkv.testing.ruler import ANSWER_TOKENS, TASKS, make_sample, string_match_all  # noqa: E402

PATHS = ("full", "cold", "hit", "full_hit")
DEFAULT_PATHS = ("full", "cold", "hit")
AGREEMENTS = (("hit", "cold"), ("cold", "full"), ("hit", "full"), ("full_hit", "full"))
# the earlier request's question with --hit-after question: longer than the local window, so its
# compressed span holds the whole document (a shorter one leaves the document's end dense)
OTHER_QUESTION = ("\nQuestion: Before the question that comes next, describe in a few sentences what the text "
                  "above is about, which of its parts repeat and which details stand apart from the rest of it, "
                  "then list the names, numbers and codes it mentions, in the order in which they first "
                  "appear in the text, without any comment on them, and wait for the next question.")
MIN_CONTEXT = 1024  # unless --shadowkv-min-context is given
# what a hit's prefill read, recorded per hit from the engine's counters: its document's exact copy
# (from_copies), and that copy loaded into dense pages, attended by the dense kernel (copy_loaded)
HIT_READS = {"from_copies": "exact_copy_hits", "copy_loaded": "dense_copy_prefills"}


def run_path(engine: Engine, path: str, cases: list[dict], params: dict) -> list[dict]:
    """Every case's answer on one path. full and cold: each case on a flushed cache. hit: each
    case's document cached compressed by an earlier request first (kept for the next cases that
    share it): the case's `earlier` tokens, by default its document. full_hit: the same on a
    full-attention engine, the document cached dense (checked by the answer's cached tokens)."""
    outs, cached = [], None
    hit = path in ("hit", "full_hit")
    for case in cases:
        t0 = time.perf_counter()
        earlier = case.get("earlier", case["doc"]) if path == "hit" else case["doc"]
        if not hit or earlier != cached:
            engine.flush_cache()
        if hit and earlier != cached:
            if path == "hit":
                cache_document(engine, earlier)
            else:
                engine.generate(input_ids=earlier, sampling_params={"max_new_tokens": 0})
            cached = earlier
        out = generate_checked(engine, case["ids"], params, path if path in ("cold", "hit") else None)
        if path == "full_hit" and out["meta_info"]["cached_tokens"] < len(case["doc"]) // 2:
            raise RuntimeError(f"a full_hit request found {out['meta_info']['cached_tokens']} of its document's "
                               f"{len(case['doc'])} tokens cached")
        outs.append({"text": out["text"], "output_ids": out["output_ids"],
                     "score": string_match_all(out["text"], case["sample"].outputs),
                     "seconds": round(time.perf_counter() - t0, 1),
                     **({key: bool(out["counters"][counter]) for key, counter in HIT_READS.items()}
                        if path == "hit" else {})})
    engine.flush_cache()
    return outs


def run_task(engines: dict, task: str, length: int, args) -> dict:
    """Every sample of a task at one length on every asked path: rows and their summary."""
    params = {"max_new_tokens": args.max_new_tokens or ANSWER_TOKENS[task], "temperature": 0}
    any_engine = next(iter(engines.values()))  # for the tokenizer and chat template
    other = any_engine.tokenizer.encode(OTHER_QUESTION, add_special_tokens=False)
    cases = []
    for index in range(args.first_sample, args.first_sample + args.samples):
        sample, ids = make_sample(any_engine, task, length, index, args.seed)
        doc = question_prefix(any_engine, ids, sample.question)
        earlier = {"document": doc, "question": doc + other, "prompt": ids}[args.hit_after]
        cases.append({"index": index, "sample": sample, "ids": ids, "doc": doc, "earlier": earlier})
    answers = {}
    for path in args.paths:
        prompts = tqdm(cases, desc=f"{task} {length} {path}", unit="prompt", leave=False)  # 1-3 minutes a prompt at 8K on a CPU
        engine = engines["shadowkv" if path in ("cold", "hit") else "full"]
        answers[path] = run_path(engine, path, prompts, params)
        print(f"{task} {length} {path}: " + " ".join(f"{a['score']:.2f}" for a in answers[path]), flush=True)
    rows = [{"index": c["index"], "prompt_tokens": len(c["ids"]), "doc_tokens": len(c["doc"]),
             "outputs": list(c["sample"].outputs), **{p: answers[p][i] for p in args.paths}}
            for i, c in enumerate(cases)]
    summary = summarize(rows, args.paths)
    return {"task": task, "length": length, "max_new_tokens": params["max_new_tokens"], "summary": summary,
            "rows": rows}


def summarize(rows: list[dict], paths) -> dict:
    """RULER's score per path (percent), the same as answers (the sum of per-sample scores: a
    sample whose answer holds every value counts 1), and token agreement between paths."""
    out = {"samples": len(rows),
           "score": {p: round(100 * sum(r[p]["score"] for r in rows) / len(rows), 2) for p in paths},
           "answers": {p: round(sum(r[p]["score"] for r in rows), 2) for p in paths}}
    for key in HIT_READS:  # hits whose prefill read the document's exact copy (the counters say; older runs: not kept)
        read = [r["hit"][key] for r in rows if "hit" in paths and key in r["hit"]]
        if read:
            out[f"hits_{key}"] = sum(read)
    for a, b in AGREEMENTS:
        if a in paths and b in paths:
            out[f"{a}_vs_{b}"] = agreement([r[a]["output_ids"] for r in rows], [r[b]["output_ids"] for r in rows])
    return out


def print_table(result: dict) -> None:
    paths = result["paths"]
    pairs = [(a, b) for a, b in AGREEMENTS if a in paths and b in paths and (a, b) != ("hit", "full")]
    print(f"\n{'task':<16} {'len':>5} {'n':>3} " + " ".join(f"{p:>8}" for p in paths)
          + "".join(f" {a + '=' + b:>13}" for a, b in pairs))
    for block in result["tasks"]:
        s = block["summary"]
        agree = [f"{s[f'{a}_vs_{b}']['token_agreement']:>13.3f}" for a, b in pairs]
        print(f"{block['task']:<16} {block['length']:>5} {s['samples']:>3} "
              + " ".join(f"{s['score'][p]:>8.1f}" for p in paths) + " " + " ".join(agree))
    print(f"(RULER's score, percent; agreement: greedy tokens equal at equal positions) {result['seconds']} s")


def stored_rows(rows: list[dict], paths) -> list[dict]:
    """Rows as the JSON keeps them: without the answers' texts (their output_ids decode to them),
    and an answer equal to an earlier path's as {"same_as": that path}, since most hit answers
    equal the cold ones: the committed files shrank to 0.5-0.8 of their size."""
    stored = []
    for row in rows:
        row, seen = dict(row), {}
        for path in paths:
            answer = {k: v for k, v in row[path].items() if k != "text"}
            ids = tuple(answer["output_ids"])
            if ids in seen:
                answer["output_ids"] = {"same_as": seen[ids]}
            seen.setdefault(ids, path)
            row[path] = answer
        stored.append(row)
    return stored


def loaded_rows(rows: list[dict], paths) -> list[dict]:
    """The rows of a JSON file with every answer's output_ids written out (see stored_rows)."""
    loaded = []
    for row in rows:
        row = dict(row)
        for path in paths:
            ids = row[path]["output_ids"]
            if isinstance(ids, dict):
                row[path] = {**row[path], "output_ids": row[ids["same_as"]]["output_ids"]}
        loaded.append(row)
    return loaded


def stored_blocks(blocks: list[dict], paths) -> list[dict]:
    return [{**b, "rows": stored_rows(b["rows"], paths)} if "rows" in b else b for b in blocks]


def join_parts(blocks: list[dict], paths) -> dict:
    """One task and length's block from parts that each ran some of its samples, or some of its
    paths (every sample must end with an answer on each path, from one part only)."""
    if len(blocks) == 1 and "rows" not in blocks[0]:
        return blocks[0]
    where = f"{blocks[0]['task']} at {blocks[0]['length']}"
    if any("rows" not in b for b in blocks):
        raise SystemExit(f"{where}: a part keeps its summary only, not its answers, so it joins no other")
    joined: dict[int, dict] = {}
    for row in (row for b in blocks for row in b["rows"]):
        prompt = {k: v for k, v in row.items() if k not in PATHS}  # index, lengths, expected values
        have = joined.setdefault(row["index"], dict(prompt))
        if prompt != {k: v for k, v in have.items() if k not in PATHS}:
            raise SystemExit(f"{where}: sample {row['index']} is another prompt in another part")
        for path in (p for p in PATHS if p in row):
            if path in have:
                raise SystemExit(f"{where}: sample {row['index']}'s {path} answer is in two parts")
            have[path] = row[path]
    rows = [joined[i] for i in sorted(joined)]
    lacking = sorted({p for row in rows for p in paths if p not in row})
    if lacking:
        raise SystemExit(f"{where}: some samples have no {', '.join(lacking)} answer in any part")
    return {**blocks[0], "summary": summarize(rows, paths), "rows": rows}


# how much host memory a run pinned: not a setting its answers depend on (too little raises)
CAPACITY_SETTINGS = ("host_mem_fraction", "shadowkv_host_mem_fraction")
# settings that only a hit's prefill reads (cold prefills dense and decodes as a hit does)
HIT_ONLY_SETTINGS = ("exact_copy_fraction", "shadowkv_exact_copy_fraction")


def answer_settings(value, hit: bool = True):
    """A provenance field as far as a part's answers depend on it: settings without the
    capacities, and without the hit's own settings for a part without hit answers."""
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if k not in CAPACITY_SETTINGS and (hit or k not in HIT_ONLY_SETTINGS)}
    return value


def loaded_result(path: str) -> dict:
    """A result file with its rows' answers written out (see loaded_rows). A file from before the
    attention backend was recorded ran the torch backend (every RULER run did until then)."""
    with open(path) as f:
        result = json.load(f)
    blocks = [{**b, "rows": loaded_rows(b["rows"], result["paths"])} if "rows" in b else b for b in result["tasks"]]
    return {"attention_backend": "torch", **result, "tasks": blocks}


def only_paths(result: dict, keep) -> dict:
    """A loaded result with the answers of the paths in `keep` only."""
    blocks = [{**b, "rows": [{k: v for k, v in row.items() if k not in PATHS or k in keep} for row in b["rows"]]}
              if "rows" in b else b for b in result["tasks"]]
    return {**result, "paths": [p for p in result["paths"] if p in keep], "tasks": blocks}


def merge_results(paths: list[str], out: str, keep=None, tasks=TASKS) -> dict:
    """One result from runs that split the tasks, a task's samples, or the paths between them:
    their settings must agree, but for those that don't touch a part's answers (the ShadowKV
    settings to a part of full-attention paths only, the hit's earlier request and its exact
    copies to one without the hit path), so that a path run again under new settings joins the
    other paths of an earlier run. The parts of one task and length are joined in sample order. keep: the paths to keep
    (default: every path of a part); tasks: the tasks to keep."""
    results = [loaded_result(path) for path in paths]
    if keep:
        results = [only_paths(result, keep) for result in results]
    base_index = next((i for i, r in enumerate(results) if "hit" in r["paths"]),
                      next((i for i, r in enumerate(results) if "cold" in r["paths"]), 0))
    base = results[base_index]
    for path, other in zip(paths, results):
        hit = "hit" in other["paths"]
        same = ("model", "device", "dtype", "attention_backend", "seed")
        if hit or "cold" in other["paths"]:
            same += ("engine_overrides", "shadowkv_config")
        if hit:
            same += ("hit_after",)
        differ = [k for k in same if answer_settings(other.get(k), hit) != answer_settings(base.get(k), hit)]
        if differ:
            raise SystemExit(f"{path} differs from {paths[base_index]} in {', '.join(differ)}: "
                             "not one run's parts")
    all_paths = [p for p in PATHS if any(p in r["paths"] for r in results)]
    parts: dict[tuple, list[dict]] = {}
    for result in results:
        for block in (b for b in result["tasks"] if b["task"] in tasks):
            parts.setdefault((block["length"], TASKS.index(block["task"])), []).append(block)
    blocks = [join_parts(parts[key], all_paths) for key in sorted(parts)]
    merged = {**base, "paths": all_paths, "seconds": max(r["seconds"] for r in results),
              "tasks": stored_blocks(blocks, all_paths),
              "merged_from": sum(r.get("merged_from", 1) for r in results)}
    with open(out, "w") as f:
        json.dump(merged, f, separators=(",", ":"))
    return merged


def compare_runs(paths: list[str], compared: list[str], out: str) -> dict:
    """Token agreement of one path's answers between two runs on the same prompts (pairs of files:
    a, b, a, b...), per task and length, over the samples both hold, beside each run's own hit =
    cold agreement: how far two computations that are both exact part (another attention kernel,
    another machine), the spread that rounding alone gives the hit path's agreement with cold.
    compared: the path, or two (run a's answers on the first against run b's on the second: a hit
    run against an earlier run's cold answers)."""
    if len(paths) % 2:
        raise SystemExit("--compare takes pairs of results")
    path_a, path_b = (compared * 2)[:2]
    name = path_a if path_a == path_b else f"{path_a}_vs_{path_b}"
    pairs = []
    for a_path, b_path in zip(paths[::2], paths[1::2]):
        a, b = loaded_result(a_path), loaded_result(b_path)
        if path_a not in a["paths"] or path_b not in b["paths"]:
            raise SystemExit(f"--compare: {a_path} has no {path_a} answers or {b_path} no {path_b} answers")
        b_blocks = {(blk["task"], blk["length"]): blk for blk in b["tasks"] if "rows" in blk}
        tasks = []
        for blk in (x for x in a["tasks"] if "rows" in x and (x["task"], x["length"]) in b_blocks):
            other = {r["index"]: r for r in b_blocks[blk["task"], blk["length"]]["rows"]}
            rows = [(r, other[r["index"]]) for r in blk["rows"] if r["index"] in other]
            if not rows:
                continue
            if any(r["prompt_tokens"] != o["prompt_tokens"] for r, o in rows):
                raise SystemExit(f"--compare: {blk['task']} at {blk['length']} holds other prompts in {b_path}")
            row = {"task": blk["task"], "length": blk["length"], "samples": [r["index"] for r, _ in rows],
                   f"{name}_a_vs_b": agreement([r[path_a]["output_ids"] for r, _ in rows],
                                               [o[path_b]["output_ids"] for _, o in rows])}
            for side, result in (("a", blk), ("b", b_blocks[blk["task"], blk["length"]])):
                if "hit_vs_cold" in result["summary"]:
                    row[f"hit_vs_cold_{side}"] = result["summary"]["hit_vs_cold"]["token_agreement"]
                for key in HIT_READS:
                    if f"hits_{key}" in result["summary"]:
                        row[f"hits_{key}_{side}"] = result["summary"][f"hits_{key}"]
            tasks.append(row)
        if not tasks:
            raise SystemExit(f"--compare: {a_path} and {b_path} share no sample")

        def mean(key):
            values = [t[key]["token_agreement"] if isinstance(t[key], dict) else t[key] for t in tasks if key in t]
            return round(sum(values) / len(values), 3) if len(values) == len(tasks) else None

        pairs.append({"a": Path(a_path).name, "b": Path(b_path).name, "dtype": a["dtype"],
                      "attention_backend": [a["attention_backend"], b["attention_backend"]],
                      "samples": sum(len(t["samples"]) for t in tasks),
                      f"mean_{name}_a_vs_b": mean(f"{name}_a_vs_b"),
                      "same_answers": sum(t[f"{name}_a_vs_b"]["same_answers"] for t in tasks),
                      "mean_hit_vs_cold_a": mean("hit_vs_cold_a"), "mean_hit_vs_cold_b": mean("hit_vs_cold_b"),
                      **{f"hits_{key}_{side}": sum(t[f"hits_{key}_{side}"] for t in tasks)
                         for key in HIT_READS for side in "ab" if all(f"hits_{key}_{side}" in t for t in tasks)},
                      "tasks": tasks})
    result = {"path": name, "pairs": pairs}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for pair in pairs:
        print(f"{pair['a']} / {pair['b']} ({pair['dtype']}, {' / '.join(pair['attention_backend'])}): {name} "
              f"answers' tokens equal {pair[f'mean_{name}_a_vs_b']} ({pair['same_answers']} of {pair['samples']} "
              f"answers); hit = cold {pair['mean_hit_vs_cold_a']} / {pair['mean_hit_vs_cold_b']}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(ap)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS,
                    help="the tasks to run (with --merge, to keep; default: all)")
    ap.add_argument("--lengths", nargs="+", type=int, default=[4096, 8192], help="prompt + answer tokens")
    ap.add_argument("--samples", type=int, default=12, help="prompts per task and length")
    ap.add_argument("--first-sample", type=int, default=0,
                    help="the first sample's index: a task's samples split between processes (--merge joins them)")
    ap.add_argument("--paths", nargs="+", choices=PATHS,
                    help="the paths each sample is answered on (default: full cold hit; full_hit: the token "
                         "metric's floor); with --merge, the paths kept (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="answer tokens (default: RULER's per task)")
    ap.add_argument("--hit-after", choices=("document", "question", "prompt"), default="document",
                    help="the hit path's earlier request: the document alone, the document and another "
                         "question (the document compressed to its last chunk), or the prompt itself (the "
                         "cold path's compressed form)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="benchmarks/results/ruler.json")
    ap.add_argument("--table", metavar="JSON", help="print the table of an earlier result and exit")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="pairs of results on the same prompts (a b a b "
                    "...): per task, how alike one path's answers are between the two (--paths: that path, default "
                    "cold), beside each one's hit = cold; written to --out")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="write the tasks of several results (the same "
                    "model, device, dtype and settings: runs split across processes, or a ShadowKV path "
                    "run again beside an earlier run's full answers) to --out and exit")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            print_table(json.load(f))
        return
    if args.merge:
        print_table(merge_results(args.merge, args.out, keep=args.paths, tasks=args.tasks))
        return
    if args.compare:
        compare_runs(args.compare, args.paths or ["cold"], args.out)
        return
    args.paths = args.paths or list(DEFAULT_PATHS)
    # a 4K sample's document is under the default shadowkv_min_context (4096): compress it anyway
    overrides = {"shadowkv_min_context": MIN_CONTEXT, **engine_overrides(args)}
    common = engine_kwargs(args, 3 * max(args.lengths))
    t0 = time.perf_counter()
    engines = {}
    try:
        if {"full", "full_hit"} & set(args.paths):
            engines["full"] = Engine(attention="full", **common)
        engines["shadowkv"] = Engine(attention="shadowkv", **common, **overrides)  # its config goes in the JSON
        info = engines["shadowkv"].get_server_info()
        blocks = []
        for length in args.lengths:
            for task in args.tasks:
                blocks.append(run_task(engines, task, length, args))
                result = save_result(args.out, info, overrides, paths=args.paths, seed=args.seed,
                                     hit_after=args.hit_after,
                                     seconds=round(time.perf_counter() - t0, 1),
                                     tasks=stored_blocks(blocks, args.paths), indent=None)
    finally:
        for engine in engines.values():
            engine.shutdown()
    print_table(result)


if __name__ == "__main__":
    main()
