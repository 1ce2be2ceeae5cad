"""Exact copies loaded into dense pages (mem_cache/copy_loads.py): a question on a compressed
document prefills through the dense kernel over its document's exact keys and values, as full
attention does with the document cached dense; the load is shared, released when the prompt is
done or aborted, and its pages are accounted for (CPU)."""

import gc
import os

import pytest
import torch

from benchmarks.hit_fidelity import cache_document
from sglang_shadowkv.mem_cache.compressed_pool import ChunkRef
from sglang_shadowkv.mem_cache.copy_loads import chunk_runs
from sglang_shadowkv.shadowkv.request_state import build_layout
from sglang_shadowkv.testing.prompts import memo_prompts
from tests.conftest import assert_pool_clean
from tests.test_shadowkv import (SHADOW_ENGINE, _compressed_pool, document_and_questions, long_prompt,
                                 shadow_engine)  # noqa: F401 (a fixture)


@pytest.mark.parametrize("value_dtype", [torch.int8, None], ids=["int8-host-values", "exact-host-values"])
def test_a_load_puts_every_chunk_exactly_into_dense_pages_once_for_all_its_readers(value_dtype):
    """Two segments' chunks around a dense page: their exact keys and values land token-major in
    the load's pages (values from the copy beside int8 host values, else from the host pool), a
    second reader of the same prefix shares the load, no new segment takes the copies it reads,
    and the last release frees its pages and its pins."""
    pool = _compressed_pool(value_dtype=value_dtype, copy_chunks=8)
    kv, loads = pool.kv, pool.copy_loads
    assert (pool.copies.v is not None) == (value_dtype is not None)
    first, second = pool.alloc_segment(0, 12, 1), pool.alloc_segment(16, 8, 1)
    gen = torch.Generator().manual_seed(5)
    written = {}
    for seg in (first, second):
        keys, values = (torch.randn(seg.num_tokens, 2, 8, generator=gen) for _ in range(2))
        pool.write_exact_copy(0, seg, keys, values)
        pool.write_host_values(0, seg, values)
        written[seg.seg_id] = keys, values
    dense = kv.alloc(1)
    entries = [ChunkRef(first, i) for i in range(3)] + dense + [ChunkRef(second, i) for i in range(2)]
    assert chunk_runs(entries) == [(first, 0, 3), (second, 0, 2)]
    assert chunk_runs([ChunkRef(first, 0), ChunkRef(first, 2)]) == [(first, 0, 1), (first, 2, 1)]
    layout = build_layout(entries, 4)
    free = kv.num_free
    assert loads.pages_needed(layout) == 5
    load = loads.acquire(entries, layout)
    assert kv.num_free == free - 5 and loads.pages_needed(layout) == 0 and loads.num_pages == 5
    table = load.table_pages(entries)
    assert table[3] == dense[0] and table[:3] + table[4:] == load.pages
    slots = kv.slots_of_pages(table, 24)
    for side, buffer in enumerate((kv.k_buffers[0], kv.v_buffers[0])):
        assert torch.equal(buffer[slots[:12]], written[first.seg_id][side])
        assert torch.equal(buffer[slots[16:]], written[second.seg_id][side])
    shared = loads.acquire(entries, build_layout(entries, 4))  # a second question on the same prefix
    assert shared is load and shared.users == 2 and kv.num_free == free - 5
    pinned = pool.alloc_segment(32, 16, 1)  # 4 chunks: room only from the copies the load reads
    assert not pinned.copy_slots
    loads.release(load)
    assert kv.num_free == free - 5 - len(pinned.pages)
    loads.release(shared)
    assert kv.num_free == free - len(pinned.pages) and not loads.live and not loads.held_pages()
    pool.free_segment(pinned)
    assert len(pool.alloc_segment(32, 16, 1).copy_slots) == 4  # unpinned: the least recently used copy went


def test_a_question_on_a_compressed_document_prefills_as_full_attention_with_it_cached_dense(engine):
    """The question's first token over the memo compressed and cached (its copy loaded dense) has
    full attention's top log-probabilities over the memo cached dense, bit for bit: the same
    kernel over the same keys and values. The request then decodes over the compressed form."""
    from sglang_shadowkv import Engine

    shadow = Engine(**{k: v for k, v in SHADOW_ENGINE.items() if k != "shadowkv_max_budget"})
    try:
        prompts, _ = memo_prompts(shadow, 1200, 2, seed=1)
        doc = os.path.commonprefix(prompts)
        engine.flush_cache()
        engine.generate(input_ids=doc, sampling_params={"max_new_tokens": 1})
        cache_document(shadow, doc)
        scored = {"max_new_tokens": 3, "temperature": 0}
        for ids in prompts:
            before = shadow.get_server_info()["shadowkv"]
            outs = [eng.generate(input_ids=ids, sampling_params=scored, return_logprob=True,
                                 logprob_start_len=len(ids) - 1, top_logprobs_num=5) for eng in (engine, shadow)]
            after = shadow.get_server_info()["shadowkv"]
            assert [after[k] - before[k] for k in ("compressed_prefix_hits", "dense_copy_prefills")] == [1, 1]
            full, hit = (out["meta_info"] for out in outs)
            assert hit["cached_tokens"] == full["cached_tokens"] > len(doc) // 2
            assert hit["output_top_logprobs"][0] == full["output_top_logprobs"][0]
            assert hit["shadowkv"]["compressed_tokens"] > len(doc) // 2  # decoded over the compressed memo
        assert shadow.get_server_info()["memory"]["copy_load_pages"] == 0
        assert_pool_clean(shadow)
    finally:
        shadow.shutdown()
        engine.flush_cache()


def test_questions_together_share_one_load_and_an_abort_gives_it_back(shadow_engine):
    """Two long questions on one compressed document, admitted together and prefilled over several
    steps, read one load; aborting one midway keeps it for the other, whose end frees it."""
    from sglang_shadowkv.sampling_params import SamplingParams

    sched = shadow_engine.scheduler
    sched.flush_cache()
    loads = sched.runner.compressed_pool.copy_loads
    doc, questions = document_and_questions(shadow_engine.tokenizer, 1200, 61)
    long_questions = [long_prompt(shadow_engine.tokenizer, 700, seed) + q for seed, q in zip((62, 63), questions)]
    req = sched.add_request("doc", doc + questions[2], SamplingParams(max_new_tokens=1, temperature=0))
    while sched.has_work:
        sched.step()
    reqs = [sched.add_request(f"q{i}", doc + q, SamplingParams(max_new_tokens=3, temperature=0))
            for i, q in enumerate(long_questions)]
    sched.step()  # both admitted; 512 prompt tokens a step (chunked_prefill_size), so neither is done
    assert not any(r.prompt_done for r in reqs) and all(r.shadowkv.copy_load is not None for r in reqs)
    (load,) = loads.live.values()
    assert load.users == 2 and sched.stats["dense_copy_prefills"] == 2
    assert shadow_engine.get_server_info()["memory"]["copy_load_pages"] == len(load.pages) > 100
    sched.abort("q0")
    sched.step()
    assert load.users == 1
    while sched.has_work:
        sched.step()
    assert reqs[1].finished and len(reqs[1].output_ids) == 3 and not loads.live
    assert_pool_clean(shadow_engine)
    del req
    gc.collect()
