"""benchmarks/cold_and_hit.py's prompts beside decodes: the decodes run before and while a cold
document or a chat's next turn is served, the step clock over it names the step that compressed it
or prefilled the turn over the compressed document beside them, and the decodes end
(aborted) with nothing left held."""

import pytest

from benchmarks.cold_and_hit import _decode_steps, _first_token_beside_decodes
from sglang_shadowkv import Engine

# (spans to their last whole chunk, span grid 8: the documents are a few hundred tokens)
TINY = dict(attention="shadowkv", shadowkv_compress_policy="eager", shadowkv_min_context=256,
            shadowkv_local_window=16, shadowkv_span_grid=8, shadowkv_rank_cap=8, shadowkv_outliers=2,
            shadowkv_max_budget=32, shadowkv_min_budget_chunks=8, chunked_prefill_size=256, check_integrity=True)


def test_a_cold_document_beside_decodes_is_timed_and_its_compressing_step_labelled(tiny_model_path):
    doc = [2 + (j * 7) % 500 for j in range(600)]
    cold = [3 + (j * 11) % 500 for j in range(600)]
    with Engine(model_path=tiny_model_path, max_total_tokens=4000, **TINY) as engine:
        engine.generate(input_ids=doc + [5] * 8, sampling_params={"max_new_tokens": 1})  # cached, compressed
        out = _first_token_beside_decodes(engine, cold + [6] * 8, [doc + [7 + i] * 8 for i in range(3)])
        sched = engine.scheduler
        assert out["seconds"] > 0
        labels = set(out["clock"])
        assert "prefill+decode+compress" in labels  # its last chunk, compressed beside the decodes
        assert sum(shape["decode_rows"] for shape in out["clock"].values()) >= 3
        assert not sched.has_work and not sched.running
        sched.cache.check_integrity([])  # the aborted decodes left no page or row behind


@pytest.mark.parametrize("loaded", [True, False], ids=["over-its-copy-loaded-dense", "over-its-workspace"])
def test_a_next_turn_beside_decodes_prefills_over_the_compressed_document(tiny_model_path, loaded):
    """The turn's step: a dense prefill over the document's copy loaded into dense pages (the
    default), or, the pool short of pages for it, a suffix over the compressed document."""
    doc = [2 + (j * 7) % 500 for j in range(600)]
    turn = [4 + (j * 13) % 500 for j in range(150)]  # several tiles
    with Engine(model_path=tiny_model_path, max_total_tokens=4000, **TINY) as engine:
        engine.scheduler.cache.compressed.copies_loaded_dense = loaded
        engine.generate(input_ids=doc + [5] * 8, sampling_params={"max_new_tokens": 1})  # cached, compressed
        out = _first_token_beside_decodes(engine, doc + turn, [doc + [7 + i] * 8 for i in range(3)])
        assert out["clock"]["prefill+decode" if loaded else "suffix+decode"]["prompt_tokens"] >= len(turn)
        assert engine.scheduler.stats["dense_copy_prefills"] == (4 if loaded else 0)  # the decodes' questions too
        assert "prefill+decode+compress" not in out["clock"]  # the document was not prefilled again
        assert not engine.scheduler.has_work
        engine.scheduler.cache.check_integrity([])


def test_decode_steps_reads_the_decode_only_steps_of_its_prompts(tiny_model_path):
    doc = [2 + (j * 7) % 500 for j in range(600)]
    with Engine(model_path=tiny_model_path, max_total_tokens=4000, **TINY) as engine:
        engine.generate(input_ids=doc + [5] * 8, sampling_params={"max_new_tokens": 1})  # cached, compressed
        out = _decode_steps(engine, [doc + [7 + i] * 8 for i in range(3)], tokens=6)
        # the first token comes from the prompt's step, the next five from decode-only steps
        # (overlap: one more may be launched before the stop is seen)
        assert 5 <= out["steps"] <= 6
        assert out["step_ms"] > 0


def test_distinct_documents_decode_together_each_over_its_own_compressed_document(tiny_model_path):
    import numpy as np

    from benchmarks.cold_and_hit import DISTINCT_DOCS, _distinct_docs_decode

    with Engine(model_path=tiny_model_path, max_total_tokens=12000, **TINY) as engine:
        out = _distinct_docs_decode(engine, np.random.default_rng(0), 300, 500, DISTINCT_DOCS, profile=False)
        stats = engine.get_server_info()["stats"]
        assert stats["compressions"] == DISTINCT_DOCS  # each document compressed once, at its prefill
        assert stats["compressed_prefix_hits"] >= 2 * DISTINCT_DOCS  # both decoding rounds hit them
        assert out["steps"] >= 60 and out["step_ms"] > 0  # 64 tokens each, together
        engine.scheduler.cache.check_integrity([])


def test_engine_args_are_read_as_json_or_text_and_a_pair_without_a_value_is_refused():
    import pytest

    from benchmarks.cold_and_hit import engine_args

    assert engine_args(["shadowkv_disable_gpu_values=true", "shadowkv_max_budget=64", "shadowkv_budget=auto"]) == {
        "shadowkv_disable_gpu_values": True, "shadowkv_max_budget": 64, "shadowkv_budget": "auto"}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        engine_args(["shadowkv_max_budget"])


def test_cold_profile_difference_ranks_ops_by_shadowkvs_extra_device_time():
    from benchmarks.cold_and_hit import cold_profile_difference

    def mode(ops):
        return {"rows": [{"context": 16384, "profile": {"cold": {"device_top": [
            {"op": op, "ms": ms, "calls": 1} for op, ms in ops.items()]}}}]}

    modes = {"full": mode({"gemm": 300.0, "attention": 140.0, "norm": 20.0}),
             "shadowkv": mode({"gemm": 312.0, "attention": 139.0, "eigh": 9.0, "gram": 4.0})}
    [row] = cold_profile_difference(modes, top=3)
    assert row["context"] == 16384
    assert [(e["op"], e["extra_ms"]) for e in row["ops"]] == [("norm", -20.0), ("gemm", 12.0), ("eigh", 9.0)]
    assert cold_profile_difference({"shadowkv": modes["shadowkv"]}) == []  # one mode: nothing to compare

    def listed(pairs):  # two kernels whose names were cut to the same 80 characters
        return {"rows": [{"context": 16384, "profile": {"cold": {"device_top": [
            {"op": op, "ms": ms, "calls": 1} for op, ms in pairs]}}}]}

    same_name = {"full": listed([("elementwise<...", 15.0), ("elementwise<...", 2.0)]),
                 "shadowkv": listed([("elementwise<...", 2.0), ("elementwise<...", 15.5)])}
    [row] = cold_profile_difference(same_name)
    assert [(e["op"], e["extra_ms"]) for e in row["ops"]] == [("elementwise<...", 0.5)]  # summed, not -13
