"""RULER's synthetic tasks (sglang_shadowkv/testing/ruler.py): each generator fills its length with
the values its answer must hold, deterministically; RULER's scorer gives partial credit; and on a
short sample a question over its cached compressed document answers as it does cold."""

import collections
import json
import re

import pytest
from test_hit_fidelity import ENGINE, cold_and_hit_answers

from benchmarks.hit_fidelity import agreement
from sglang_shadowkv.testing.ruler import (ANSWER_TOKENS, LOOKALIKE_FACTS, NIAH_TASKS, TASKS, make_sample,
                                           string_match_all)

LENGTH = 1536


@pytest.fixture(scope="module")
def samples(engine):
    """(sample, prompt text, prompt length) of each task at LENGTH tokens, sample 0."""
    out = {}
    for task in TASKS:
        sample, ids = make_sample(engine, task, LENGTH, 0)
        out[task] = (sample, engine.tokenizer.decode(ids), len(ids))
    return out


@pytest.mark.parametrize("task", TASKS)
def test_a_sample_fills_its_length_asks_its_question_and_holds_every_expected_value(engine, samples, task):
    sample, text, tokens = samples[task]
    assert 0.9 * (LENGTH - ANSWER_TOKENS[task]) <= tokens <= LENGTH - ANSWER_TOKENS[task]
    assert text.index(sample.document) < text.index(sample.question) and text.endswith(sample.answer_prefix)
    assert sample.outputs and all(value in sample.document for value in sample.outputs)
    again, ids = make_sample(engine, task, LENGTH, 0)
    assert again == sample and engine.tokenizer.decode(ids) == text  # deterministic
    assert make_sample(engine, task, LENGTH, 1)[0].outputs != sample.outputs


@pytest.mark.parametrize("task", NIAH_TASKS)
def test_niah_needles_follow_ruler_configurations(samples, task):
    cfg = NIAH_TASKS[task]
    sample, _, _ = samples[task]
    needles = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", sample.document)
    keys = collections.Counter(k for k, _ in needles)
    asked = [k for k in keys if k in sample.question]
    assert len(asked) == cfg.num_q and sum(keys[k] for k in asked) == cfg.num_q * cfg.num_v
    assert sorted(v for k, v in needles if k in asked) == sorted(sample.outputs)
    if cfg.haystack == "needle":  # the haystack is other needles
        assert len(keys) > 10
    else:
        assert len(keys) == max(cfg.num_k, cfg.num_q)


def test_variable_tracking_chain_is_in_order_and_every_variable_is_asked(samples):
    sample, _, _ = samples["vt"]
    main = sample.document[sample.document.rindex("Memorize and track"):]
    chain = re.findall(r"VAR (\w+) = (?:VAR (\w+)|(\d+))", main)
    assert [name for name, _, _ in chain] == list(sample.outputs) and chain[0][2] in sample.question
    assert all(prev == chain[i][0] for i, (_, prev, _) in enumerate(chain[1:]))


def test_word_extraction_answers_are_the_most_frequent_words(samples):
    cwe, _, _ = samples["cwe"]
    listed = collections.Counter(re.findall(r"\d+\. (\w+)", cwe.document[cwe.document.rindex("Below is"):]))
    assert {w for w, _ in listed.most_common(10)} == set(cwe.outputs)
    assert min(listed[w] for w in cwe.outputs) > max(n for w, n in listed.items() if w not in cwe.outputs)
    fwe, _, _ = samples["fwe"]
    counts = collections.Counter(fwe.document.split("words. ", 1)[1].split())
    assert [w for w, _ in counts.most_common(4)] == ["...", *fwe.outputs]


def test_lookalike_facts_share_one_template_and_one_is_asked(samples):
    sample, _, _ = samples["lookalike"]
    facts = re.findall(r"The access code for room (\d+) is (\d+)\.", sample.document)
    assert len(facts) == LOOKALIKE_FACTS and len({v for _, v in facts}) == LOOKALIKE_FACTS
    assert [v for room, v in facts if f"room {room}?" in sample.question] == list(sample.outputs)


def test_string_match_all_is_the_share_of_values_found_case_insensitively():
    assert string_match_all("They are ABC-1 and 42.", ("abc-1", "42")) == 1.0
    assert string_match_all("only 42", ("abc-1", "42", "7", "8")) == 0.25
    assert string_match_all("", ("x",)) == 0.0


def test_a_lookalike_question_on_its_cached_compressed_memo_answers_as_it_does_cold():
    """Three questions of one look-alike memo, each cold, then each over the memo cached compressed."""
    from sglang_shadowkv import Engine

    engine = Engine(**ENGINE)
    try:
        prompts = [make_sample(engine, "lookalike", LENGTH, asked)[1] for asked in range(3)]
        cold, hit = cold_and_hit_answers(engine, prompts)
    finally:
        engine.shutdown()
    same = agreement(hit, cold)
    assert same["first_token"] == len(prompts) and same["token_agreement"] >= 0.95, same


@pytest.mark.parametrize("hit_after", ["document", "question", "prompt"])
def test_each_earlier_request_of_the_hit_path_leaves_its_own_compressed_span(hit_after):
    """`ruler.py --hit-after`: the hit path's earlier request holds the document alone (compressed
    but for its last 64 tokens: the local window), with OTHER_QUESTION after it (compressed to its
    last whole chunk, as a chat's next question finds it), or the prompt itself (compressed but for
    the window, as the cold path compresses it); either way the question is a hit. Spans to the
    last whole chunk (span grid 8): at the default grid all three end on the same line here."""
    from benchmarks.hit_fidelity import question_prefix
    from benchmarks.ruler import OTHER_QUESTION, run_path
    from sglang_shadowkv import Engine

    engine = Engine(**ENGINE, shadowkv_span_grid=8)
    try:
        sample, ids = make_sample(engine, "niah_single_1", LENGTH, 0)
        doc = question_prefix(engine, ids, sample.question)
        other = engine.tokenizer.encode(OTHER_QUESTION, add_special_tokens=False)
        earlier = {"document": doc, "question": doc + other, "prompt": ids}[hit_after]
        reused = engine.get_server_info()["shadowkv"]["compressed_tokens_reused"]
        case = {"sample": sample, "ids": ids, "doc": doc, "earlier": earlier}
        (answer,) = run_path(engine, "hit", [case], {"max_new_tokens": 2})
        reused = engine.get_server_info()["shadowkv"]["compressed_tokens_reused"] - reused
        cfg = engine.scheduler.cache.compressed.cfg
        chunk, window = cfg.chunk_size, cfg.local_window
    finally:
        engine.shutdown()
    assert len(answer["output_ids"]) == 2
    if hit_after == "question":
        assert len(doc) - chunk < reused <= len(doc)
    elif hit_after == "prompt":
        assert len(ids) - window - chunk < reused <= len(ids) - window
    else:
        assert reused <= len(doc) - window


def result_part(path, tasks: list[dict], **fields) -> str:
    """A part of a ruler.py run written to `path`: its task blocks under a provenance that `fields`
    may change (a part with other settings is not of the same run)."""
    result = {"model": "m", "device": "cuda", "dtype": "float32", "engine_overrides": {}, "shadowkv_config": {},
              "paths": ["full", "cold", "hit"], "seed": 0, "seconds": 1.0, "tasks": tasks, **fields}
    path.write_text(json.dumps(result))
    return str(path)


def test_results_of_one_run_split_across_processes_merge_in_task_order(tmp_path):
    """`ruler.py --merge`: the parts' tasks in one file, lengths then RULER's task order; parts run
    with other settings are refused (they are not one run)."""
    from benchmarks.ruler import merge_results

    def part(name, tasks, seconds, **settings):
        return result_part(tmp_path / name, [{"task": t, "length": n, "summary": {}} for t, n in tasks],
                           seconds=seconds, **settings)

    a = part("a.json", [("lookalike", 8192), ("vt", 4096)], 30.0)
    b = part("b.json", [("niah_single_1", 4096), ("niah_single_1", 8192)], 50.0)
    merged = merge_results([a, b], str(tmp_path / "all.json"))
    assert [(t["task"], t["length"]) for t in merged["tasks"]] == [
        ("niah_single_1", 4096), ("vt", 4096), ("niah_single_1", 8192), ("lookalike", 8192)]
    assert merged["seconds"] == 50.0 and merged["merged_from"] == 2
    other = part("c.json", [("cwe", 4096)], 10.0, dtype="bfloat16")
    with pytest.raises(SystemExit, match="dtype"):
        merge_results([a, other], str(tmp_path / "bad.json"))
    triton = part("d.json", [("cwe", 4096)], 10.0, attention_backend="triton")  # a: before the field, torch
    with pytest.raises(SystemExit, match="attention_backend"):
        merge_results([a, triton], str(tmp_path / "bad.json"))


def test_two_runs_on_the_same_prompts_compare_one_paths_answers(tmp_path):
    """`ruler.py --compare a.json b.json`: per task, how alike the cold answers of two runs are (the
    spread of two exact computations), beside each run's hit = cold, over the samples both hold; a
    run's hit answers against another's cold ones (--paths hit cold); other prompts are refused."""
    from benchmarks.ruler import compare_runs

    def run(name, cold, hit=None, prompt_tokens=100, **fields):
        rows = [{"index": i, "prompt_tokens": prompt_tokens, "cold": {"output_ids": ids, "score": 0.0},
                 **({"hit": {"output_ids": hit[i], "score": 0.0}} if hit else {})} for i, ids in enumerate(cold)]
        summary = {"hit_vs_cold": {"token_agreement": 0.5}, "hits_from_copies": len(hit)} if hit else {}
        return result_part(tmp_path / name, [{"task": "vt", "length": 4096, "summary": summary, "rows": rows}],
                           paths=["cold", "hit"] if hit else ["cold"], **fields)

    torch_run = run("torch.json", [[1, 2, 3, 4], [5, 6]], hit=[[1, 2, 0, 0], [5, 6]])
    triton_run = run("triton.json", [[1, 2, 3, 9], [5, 6]], attention_backend="triton")
    result = compare_runs([triton_run, torch_run], ["cold"], str(tmp_path / "spread.json"))
    (pair,) = result["pairs"]
    assert pair["attention_backend"] == ["triton", "torch"] and pair["mean_cold_a_vs_b"] == round(5 / 6, 3)
    assert pair["tasks"][0]["cold_a_vs_b"]["same_answers"] == 1
    assert pair["mean_hit_vs_cold_a"] is None and pair["mean_hit_vs_cold_b"] == 0.5
    assert pair["hits_from_copies_b"] == 2 and "hits_from_copies_a" not in pair
    hit_half = run("hit_half.json", [[0]], hit=[[1, 2, 3, 4]])  # a run cut short: its first sample
    (pair,) = compare_runs([hit_half, torch_run], ["hit", "cold"], str(tmp_path / "hit.json"))["pairs"]
    assert pair["samples"] == 1 and pair["tasks"][0]["samples"] == [0] and pair["mean_hit_vs_cold_a_vs_b"] == 1.0
    other = run("other.json", [[1], [5]], prompt_tokens=7)
    with pytest.raises(SystemExit, match="other prompts"):
        compare_runs([other, torch_run], ["cold"], str(tmp_path / "bad.json"))
    with pytest.raises(SystemExit, match="pairs"):
        compare_runs([other], ["cold"], str(tmp_path / "bad.json"))


def test_a_full_hit_answers_as_full_attention_does_over_the_document_cached_dense(engine):
    """`ruler.py --paths full_hit`, the token metric's floor: the document cached dense by an earlier
    request (run_path checks the cached tokens), and the answer equal to full attention's."""
    from benchmarks.hit_fidelity import question_prefix
    from benchmarks.ruler import run_path

    sample, ids = make_sample(engine, "niah_single_1", LENGTH, 0)
    case = {"sample": sample, "ids": ids, "doc": question_prefix(engine, ids, sample.question)}
    (full,) = run_path(engine, "full", [case], {"max_new_tokens": 6, "temperature": 0})
    (full_hit,) = run_path(engine, "full_hit", [case], {"max_new_tokens": 6, "temperature": 0})
    assert len(full["output_ids"]) == 6 and full_hit["output_ids"] == full["output_ids"]


def test_stored_rows_drop_texts_and_repeat_no_answer_yet_load_back_whole():
    """A result keeps each distinct answer once: an answer equal to an earlier path's is a reference."""
    from benchmarks.ruler import loaded_rows, stored_rows

    paths = ["full", "cold", "hit"]
    rows = [{"index": 0, "full": {"text": "a", "output_ids": [1, 2], "score": 1.0},
             "cold": {"text": "b", "output_ids": [1, 3], "score": 0.0},
             "hit": {"text": "b", "output_ids": [1, 3], "score": 0.0}}]
    stored = stored_rows(rows, paths)
    assert stored[0]["hit"]["output_ids"] == {"same_as": "cold"} and stored[0]["cold"]["output_ids"] == [1, 3]
    assert all("text" not in stored[0][p] for p in paths) and "text" in rows[0]["full"]  # the rows untouched
    assert loaded_rows(stored, paths) == [{**rows[0], **{p: {k: v for k, v in rows[0][p].items() if k != "text"}
                                                         for p in paths}}]


def test_a_task_split_by_samples_across_processes_merges_into_one_task(tmp_path):
    """`ruler.py --first-sample`: a task's halves join in sample order, their summary taken over
    all samples; a sample in two parts is refused."""
    from benchmarks.ruler import merge_results

    def part(name, indices):
        rows = [{"index": i, "full": {"output_ids": [i, 1], "score": 1.0},
                 "cold": {"output_ids": [i, 1 + i % 2], "score": 0.5}} for i in indices]
        return result_part(tmp_path / name, [{"task": "vt", "length": 4096, "summary": {}, "rows": rows}],
                           device="cpu", paths=["full", "cold"])

    merged = merge_results([part("b.json", [2, 3]), part("a.json", [0, 1])], str(tmp_path / "all.json"))
    (block,) = merged["tasks"]
    assert [r["index"] for r in block["rows"]] == [0, 1, 2, 3]
    assert block["summary"]["answers"] == {"full": 4.0, "cold": 2.0}
    assert block["summary"]["cold_vs_full"]["same_answers"] == 2
    assert json.loads((tmp_path / "all.json").read_text())["tasks"][0]["rows"][0]["cold"]["output_ids"] == {
        "same_as": "full"}
    with pytest.raises(SystemExit, match="two parts"):
        merge_results([part("a.json", [0, 1]), part("c.json", [1, 2])], str(tmp_path / "bad.json"))


def test_a_shadowkv_path_run_again_joins_an_earlier_runs_full_answers(tmp_path):
    """`ruler.py --merge full.json cold_hit.json`: the ShadowKV paths of a run under new ShadowKV
    settings join the full answers of an earlier run (which those settings don't touch; `--paths
    full` takes them from that run's file) per sample, as a hit after another earlier request (or
    reading exact copies) joins the cold answers, whatever host memory each run pinned; other
    model settings, another prompt or a path no part answers are refused."""
    from benchmarks.ruler import merge_results

    def part(name, paths, indices=(0, 1), **settings):
        rows = [{"index": i, "prompt_tokens": 100 + i, "outputs": ["7"],
                 **{p: {"output_ids": [i, p == "full"], "score": float(p == "full")} for p in paths}}
                for i in indices]
        return result_part(tmp_path / name, [{"task": "vt", "length": 4096, "summary": {}, "rows": rows}],
                           paths=paths, **settings)

    earlier = part("earlier.json", ["full", "cold", "hit"], shadowkv_config={"span_grid": 8})
    full = str(tmp_path / "full.json")
    full_only = merge_results([earlier], full, keep=["full"])  # the earlier run's full answers alone
    assert full_only["paths"] == ["full"]
    assert set(full_only["tasks"][0]["rows"][0]) == {"index", "prompt_tokens", "outputs", "full"}
    cold_hit = part("cold_hit.json", ["cold", "hit"], shadowkv_config={"span_grid": 512, "host_mem_fraction": 0.1})
    merged = merge_results([full, cold_hit], str(tmp_path / "all.json"))
    assert merged["paths"] == ["full", "cold", "hit"] and merged["shadowkv_config"]["span_grid"] == 512
    (block,) = merged["tasks"]
    assert block["summary"]["answers"] == {"full": 2.0, "cold": 0.0, "hit": 0.0}
    assert block["summary"]["hit_vs_cold"]["token_agreement"] == 1.0
    assert block["summary"]["cold_vs_full"]["token_agreement"] == 0.5  # [i, 0] against [i, 1]
    # a hit path with another earlier request joins a cold path run with less pinned memory
    hit = part("hit.json", ["hit"], shadowkv_config={"span_grid": 512, "host_mem_fraction": 0.2}, hit_after="prompt")
    cold = str(tmp_path / "cold.json")
    assert merge_results([cold_hit], cold, keep=["cold"])["paths"] == ["cold"]
    assert merge_results([cold, hit], str(tmp_path / "x.json"))["hit_after"] == "prompt"
    # a hit path with exact copies joins a cold path run before the setting existed; hit paths don't
    copied = part("copied.json", ["hit"], shadowkv_config={"span_grid": 512, "exact_copy_fraction": 0.25})
    assert merge_results([cold, copied], str(tmp_path / "y.json"))["paths"] == ["cold", "hit"]
    with pytest.raises(SystemExit, match="shadowkv_config"):
        merge_results([copied, cold_hit], str(tmp_path / "z.json"), keep=["hit"])
    other_prompt = [{"index": 0, "prompt_tokens": 5, "outputs": ["7"], "full": {"output_ids": [0], "score": 1.0}}]
    bad = {"dtype": part("bf16.json", ["full"], dtype="bfloat16"),
           "shadowkv_config": part("grid8.json", ["hit"], shadowkv_config={"span_grid": 8}),
           "another prompt": result_part(tmp_path / "other.json", [{"task": "vt", "length": 4096, "summary": {},
                                                                   "rows": other_prompt}], paths=["full"]),
           "no full answer": part("half.json", ["full"], indices=(0,)),
           "two parts": full}
    for why, other in bad.items():
        with pytest.raises(SystemExit, match=why):
            merge_results([other, cold_hit] + ([full] if why == "two parts" else []), str(tmp_path / "bad.json"))

