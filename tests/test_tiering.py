"""Compression as a tier of the radix cache (policy "tier", the default): documents stay dense while
the pool holds them, the least recently used are demoted to compressed form when it does not, a
question on a hot document is served exactly as full attention serves it and one on a demoted
document hits it compressed; pool accounting holds after any sequence of requests, demotions,
aborts and evictions. On the tiny random model (rank 8: four chunks a page), so steps are fast."""

import pytest
from hypothesis import HealthCheck, given, settings

from sglang_shadowkv import Engine
from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.scheduler import demotion
from sglang_shadowkv.scheduler.compressed_tier import EAGER_SHARE
from cache_ops import OPS, run_ops

DOC_TOKENS = 600
# a small compressed form for small documents (spans to their last whole chunk: span grid 8)
TIER = dict(attention="shadowkv", shadowkv_min_context=256, shadowkv_local_window=16, shadowkv_span_grid=8,
            shadowkv_rank_cap=8, shadowkv_outliers=2, shadowkv_max_budget=32, shadowkv_min_budget_chunks=8,
            chunked_prefill_size=256, check_integrity=True)
GREEDY = {"max_new_tokens": 6, "temperature": 0}


def document(i: int) -> list[int]:
    return [2 + (i * 131 + j * 7) % 500 for j in range(DOC_TOKENS)]


def question(i: int) -> list[int]:
    return [2 + (i * 17 + j) % 500 for j in range(12)]


def tier_counters(engine) -> dict:
    info = engine.get_server_info()
    clock = {f"clock {label} {f}": n for label, shape in info["steps"]["clock"].items() for f, n in shape.items()}
    return {**info["stats"], **clock, **{k: info["shadowkv"][k] for k in ("demotions", "demoted_tokens")}}


@pytest.fixture(scope="module")
def tiny_tier(tiny_model_path):
    """A pool of 2400 tokens: three of the 600-token documents dense, with room for questions."""
    with Engine(model_path=tiny_model_path, max_total_tokens=2400, **TIER) as engine:
        yield engine


@pytest.fixture(scope="module")
def tiny_full(tiny_model_path):
    with Engine(model_path=tiny_model_path, max_total_tokens=16384, chunked_prefill_size=256) as engine:
        yield engine


def test_documents_stay_dense_while_they_fit_and_answer_as_full_attention(tiny_tier, tiny_full):
    tiny_tier.flush_cache()
    for i in range(2):
        tiny_tier.generate(input_ids=document(i) + question(i), sampling_params=GREEDY)
    before = tier_counters(tiny_tier)
    hot = tiny_tier.generate(input_ids=document(0) + question(9), sampling_params=GREEDY)
    after = tier_counters(tiny_tier)
    assert after["compressions"] == after["demotions"] == 0  # nothing compressed: it all fits
    assert after["dense_prefix_hits"] == before["dense_prefix_hits"] + 1
    assert hot["meta_info"]["cached_tokens"] >= DOC_TOKENS - 8 and hot["meta_info"]["shadowkv"]["compressed_tokens"] == 0
    want = tiny_full.generate(input_ids=document(0) + question(9), sampling_params=GREEDY)
    assert hot["output_ids"] == want["output_ids"]  # a dense hit is full attention, token for token


def test_new_documents_demote_the_least_recently_used_and_a_question_hits_it_compressed(tiny_tier):
    tiny_tier.flush_cache()
    for i in range(5):  # five documents through a pool that holds three dense
        tiny_tier.generate(input_ids=document(i) + question(i), sampling_params=GREEDY)
    mid = tier_counters(tiny_tier)
    assert mid["demotions"] >= 2 and mid["demoted_tokens"] >= 2 * 512
    assert mid["reprefilled_tokens"] == 0
    out = tiny_tier.generate(input_ids=document(0) + question(7), sampling_params=GREEDY)  # the oldest
    after = tier_counters(tiny_tier)
    assert after["compressed_prefix_hits"] == mid["compressed_prefix_hits"] + 1
    assert after["suffix_steps"] == mid["suffix_steps"] + 1 and after["suffix_step_ms"] > mid["suffix_step_ms"]
    assert after["clock suffix steps"] - mid.get("clock suffix steps", 0) == 1  # the step clock's label: alone
    assert after["clock suffix prompt_tokens"] - mid.get("clock suffix prompt_tokens", 0) == (
        DOC_TOKENS + 12 - out["meta_info"]["cached_tokens"])
    assert out["meta_info"]["shadowkv"]["compressed_tokens"] >= 512  # its compressed span
    assert out["meta_info"]["cached_tokens"] >= DOC_TOKENS - 8  # nothing prefilled again
    assert after["prefill_tokens"] - mid["prefill_tokens"] == DOC_TOKENS + 12 - out["meta_info"]["cached_tokens"]


def test_demotion_works_a_few_layers_per_step_while_requests_decode(tiny_tier, monkeypatch):
    """A demotion started while a request decodes advances by its per-step share of work (here
    one layer a step), between the request's decode steps, not all at once."""
    monkeypatch.setattr(demotion, "TOKEN_LAYERS_PER_STEP", 1)  # one layer a step on this 2-layer model
    tiny_tier.flush_cache()
    sched = tiny_tier.scheduler
    for i in range(3):
        tiny_tier.generate(input_ids=document(i) + question(i), sampling_params=GREEDY)
    demoter = sched.cache.compressed.demoter
    before = demoter.counters.demotions
    req = sched.add_request("long", document(3)[:300], SamplingParams(max_new_tokens=40, ignore_eos=True))
    seen = []  # (layer of the running job, tokens the request has) after each step
    while sched.has_work:
        sched.step()
        if demoter.job is not None:
            seen.append((demoter.job.layer, req.num_computed))
    assert req.finished and demoter.counters.demotions > before
    assert (1, req.num_computed) not in seen  # the job was under way while the request still decoded
    assert any(layer == 1 for layer, _ in seen)  # one layer done, one to go: it took several steps


def test_a_request_waiting_for_a_demotion_gets_it_in_one_step(tiny_tier, monkeypatch):
    """A demotion that a waiting request needs (it cannot start until the job frees pages) does all
    its layers in the step it starts, though a request decodes: the waiting one's first token
    waits on it, a decode step only a little."""
    monkeypatch.setattr(demotion, "TOKEN_LAYERS_PER_STEP", 1)  # one layer a step, unless urgent
    tiny_tier.flush_cache()
    sched = tiny_tier.scheduler
    for i in range(3):  # the three documents the pool holds dense
        tiny_tier.generate(input_ids=document(i) + question(i), sampling_params=GREEDY)
    demoter = sched.cache.compressed.demoter
    before = demoter.counters.demotions
    busy = sched.add_request("busy", question(1), SamplingParams(max_new_tokens=60, ignore_eos=True))
    sched.step()
    new = sched.add_request("new", document(3) + question(3), SamplingParams(**GREEDY))
    layers = []  # the running job's next layer after each step
    while not new.prompt_done:
        sched.step()
        if demoter.job is not None:
            layers.append(demoter.job.layer)
    assert demoter.counters.demotions > before and not busy.finished
    assert 1 not in layers  # never half done: both layers went in one step


def test_long_documents_asked_at_once_beyond_the_pool_are_compressed_at_prefill(tiny_tier):
    tiny_tier.flush_cache()
    before = tier_counters(tiny_tier)
    prompts = [document(10 + i) + question(i) for i in range(4)]  # 2448 tokens asked at once > 0.8 of 2400
    tiny_tier.generate(input_ids=prompts, sampling_params=[GREEDY] * 4)
    after = tier_counters(tiny_tier)
    assert after["compressed_requests"] - before["compressed_requests"] >= 1
    compressing = sum(n - before.get(k, 0) for k, n in after.items() if k.startswith("clock ") and
                      "+compress " in k and k.endswith(" steps"))
    assert compressing >= 1  # the step clock names the steps that compressed a prompt


def test_a_document_is_compressed_at_prefill_when_running_compressed_requests_hold_the_room(tiny_model_path):
    """The dense room is the pool less what compressed requests in use hold (segments, GPU values,
    scratch rows): beside five questions decoding over compressed documents a new document is
    compressed at its prefill (though it is a fifth of the pool); alone it stays dense."""
    with Engine(model_path=tiny_model_path, max_total_tokens=4000, **TIER) as engine:
        sched, tier = engine.scheduler, engine.scheduler.cache.compressed
        tier.policy = "eager"
        engine.generate(input_ids=[document(30 + i) + question(0) for i in range(5)], sampling_params=[GREEDY] * 5)
        tier.policy = "tier"
        # the questions prefill over their workspaces: loads of their documents' copies would take
        # the unused pages that the reservations after them then reclaim from a document's GPU values
        tier.copies_loaded_dense = False
        busy = [sched.add_request(f"d{i}", document(30 + i) + question(1 + i),
                                  SamplingParams(max_new_tokens=40, ignore_eos=True)) for i in range(5)]
        for _ in range(3):
            sched.step()
        assert tier.in_use_pages() > sched.pool.capacity - DOC_TOKENS / (EAGER_SHARE * sched.page_size)
        assert engine.get_server_info()["memory"]["compressed_in_use_pages"] == tier.in_use_pages()
        before = tier.counters.compressed_requests
        new = sched.add_request("new", document(40) + question(5), SamplingParams(max_new_tokens=2, ignore_eos=True))
        while not new.finished:
            sched.step()
        assert tier.counters.compressed_requests == before + 1 and not any(r.finished for r in busy)
        while sched.has_work:
            sched.step()
            sched.cache.check_integrity(sched.running)
        assert tier.in_use_pages() == 0  # nothing in use: the cached segments can be dropped
        engine.generate(input_ids=document(41) + question(5), sampling_params=GREEDY)
        assert tier.counters.compressed_requests == before + 1  # alone it stays dense


@pytest.fixture(scope="module")
def tiny_tight(tiny_model_path):
    """Two of the documents dense at most: most sequences demote."""
    with Engine(model_path=tiny_model_path, max_total_tokens=1700, **TIER) as engine:
        yield engine


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(OPS)
def test_pool_accounting_holds_after_any_sequence(tiny_tight, ops):
    """Requests on six documents (some demoted, some hit dense or compressed), partial steps,
    aborts mid-prefill or mid-decode, flushes and evictions: after each, every page, compressed
    slot, segment and row is free or owned exactly once."""
    run_ops(tiny_tight.scheduler, ops, lambda op, doc, count: document(doc) + question(count) if op == "doc"
            else question(count))


def test_demotion_waits_for_readers_and_survives_aborts_flushes_and_evictions(tiny_tight, monkeypatch):
    """A request that matches a span being demoted reads it dense and the swap waits for it; an
    abort, a flush mid-demotion (the job is given up) and evicting everything leave the pools
    whole at every step."""
    monkeypatch.setattr(demotion, "TOKEN_LAYERS_PER_STEP", 1)
    engine, sched = tiny_tight, tiny_tight.scheduler
    demoter = sched.cache.compressed.demoter

    def step_until(done, limit=200):
        for _ in range(limit):
            if done():
                return
            sched.step()
            sched.cache.check_integrity(sched.running)
        raise AssertionError("did not happen within the step limit")

    def add(rid, ids, n=30):
        return sched.add_request(rid, ids, SamplingParams(max_new_tokens=n, ignore_eos=True))

    engine.flush_cache()
    for i in range(2):
        engine.generate(input_ids=document(i) + question(i), sampling_params=GREEDY)
    add("busy", question(1), 200)  # something decodes all along: demotion goes a layer a step
    sched.step()
    monkeypatch.setattr(demotion, "HEADROOM_SHARE", 1.0)
    sched.cache.maintain(sched.running, idle=False)  # under the watermark: a job starts, a layer a step
    monkeypatch.setattr(demotion, "HEADROOM_SHARE", 0.1)
    assert demoter.job is not None and demoter.job.layer == 1 and demoter.job.start == 0
    span = demoter.job.num_tokens
    reader = add("reader", document(0) + question(5))  # the least recently used: the span being demoted
    step_until(lambda: reader.prompt_done)
    step_until(lambda: demoter.job.layer == 2)
    for _ in range(3):
        sched.step()
    assert demoter.job is not None  # compressed, waiting for the reader, which reads it dense
    assert reader.cached_tokens >= DOC_TOKENS - 8 and reader.shadowkv is None
    assert sched.abort("reader")
    step_until(lambda: demoter.job is None)
    assert demoter.counters.demoted_tokens >= span
    reprefilled = sched.cache.counters.reprefilled_tokens  # the counters run since the engine started
    add("third", document(2) + question(2))  # waits for a demotion of doc 1 rather than dropping it
    step_until(lambda: sched.prefill.waiting and demoter.job is not None or not sched.prefill.waiting)
    step_until(lambda: not sched.prefill.waiting)
    assert sched.cache.counters.reprefilled_tokens == reprefilled and sched.cache.tree.total_chunks > 0
    add("fourth", document(3) + question(3))
    step_until(lambda: demoter.job is not None or not sched.prefill.waiting)
    assert engine.scheduler.abort("busy")
    step_until(lambda: not sched.has_work)
    assert engine.flush_cache()  # gives up a job still under way, if any
    assert demoter.job is None
    sched.cache.check_integrity([])
    for i in range(4):
        engine.generate(input_ids=document(i) + question(i), sampling_params=GREEDY)
    sched.cache.make_room(sched.pool.capacity)  # evict everything: dense first, compressed last
    sched.cache.check_integrity([])
    assert sched.cache.tree.total_pages == sched.cache.tree.total_chunks == 0
    assert sched.pool.num_free == sched.pool.capacity - 1  # all but the compressed pool's null page


def test_a_request_short_only_of_its_compressed_extras_starts_the_demotion_it_waits_for(tiny_tight):
    """Long documents asked at once are compressed at their prefill, so the first needs its
    segment's and scratch row's pages besides its own: when only those are short, admission waits
    for a demotion, and the demotion must start for that whole need (its tokens alone fit)."""
    engine, sched = tiny_tight, tiny_tight.scheduler
    cache, tier = sched.cache, sched.cache.compressed
    engine.flush_cache()
    engine.generate(input_ids=document(0) + question(0), sampling_params=GREEDY)  # dense, cached: to demote
    prompts = [document(2 + i) + question(i) for i in range(3)]  # more than the pool holds dense
    need = cache.pages_for(len(prompts[0]) + GREEDY["max_new_tokens"])
    chunks = tier.cfg.compressed_len(len(prompts[0]), sched.page_size) // tier.cfg.chunk_size
    extra = tier.store.pages_for(chunks, tier.cfg.num_outliers(chunks)) + tier.decoder.row_pages
    filler = 0
    while sched.pool.num_free >= need + extra:  # short dense prompts, cached, until only the extras are short
        tokens = min(200, (sched.pool.num_free - need - extra // 2) * sched.page_size)
        engine.generate(input_ids=[3 + (filler * 13 + j) % 400 for j in range(tokens)], sampling_params=GREEDY)
        filler += 1
    assert need <= sched.pool.num_free < need + extra
    demotions = cache.demoter.counters.demotions
    reqs = [sched.add_request(f"d{i}", ids, SamplingParams(max_new_tokens=GREEDY["max_new_tokens"], temperature=0))
            for i, ids in enumerate(prompts)]
    for _ in range(300):
        if not sched.has_work:
            break
        sched.step()
        sched.cache.check_integrity(sched.running)
    assert all(r.finished for r in reqs) and cache.demoter.counters.demotions > demotions


def test_warmup_compresses_whatever_the_policy(tiny_tier, monkeypatch):
    """The GPU server's warmup compiles the compressed path's kernels: under the tier policy too it
    compresses its document, then leaves the policy, the cache and the counters as they were."""
    from sglang_shadowkv.scheduler.warmup import warm_up

    sched = tiny_tier.scheduler
    tier = sched.cache.compressed
    calls = []
    monkeypatch.setattr(tier, "count_compression", lambda seg, what: calls.append(seg.num_tokens))
    tiny_tier.flush_cache()
    before = dict(sched.stats)
    warm_up(sched)
    assert calls and tier.policy == "tier" and dict(sched.stats) == before
    assert sched.cache.tree.total_pages == sched.cache.tree.total_chunks == 0


def test_the_integrity_check_catches_a_leaked_page_and_a_segment_page_freed_twice(tiny_tier):
    """The idle-time check (`--check-integrity`) is not vacuous: a page taken and never owned, and a
    compressed segment's page handed back to the free list while the segment lives, both raise."""
    engine, sched = tiny_tier, tiny_tier.scheduler
    engine.generate(input_ids=document(7) + question(7), sampling_params=GREEDY)
    sched.run_when_idle()  # whole: passes
    leaked = sched.pool.alloc(1)
    with pytest.raises(RuntimeError, match="page"):
        sched.run_when_idle()
    sched.pool.free(leaked)
    sched.run_when_idle()
    store = sched.cache.compressed.store
    sched.pool.free([store.null_page])  # the compressed pool's page, also on the free list
    with pytest.raises(RuntimeError, match="page"):
        sched.run_when_idle()
    assert sched.pool.alloc(1) == [store.null_page]  # taken back (a LIFO free list): whole again
    sched.run_when_idle()


def compressed_document(engine, monkeypatch, i: int) -> list[int]:
    """Document i, compressed at its prefill and cached (the eager policy for this test)."""
    monkeypatch.setattr(engine.scheduler.cache.compressed, "policy", "eager")
    engine.flush_cache()
    engine.generate(input_ids=document(i) + question(0), sampling_params=GREEDY)
    assert engine.scheduler.cache.tree.total_chunks > 0
    return document(i)


def test_a_compressed_request_takes_its_scratch_pages_from_the_pool_while_it_runs(tiny_tier, monkeypatch):
    """The chunk-cache scratch is row_pages pages of the dense pool, held by the request's row from
    admission to its end (counted by the integrity check: one of them also on the free list is an
    error), then free again."""
    sched = tiny_tier.scheduler
    decoder = sched.cache.compressed.decoder
    doc = compressed_document(tiny_tier, monkeypatch, 20)
    req = sched.add_request("q", doc + question(1), SamplingParams(max_new_tokens=8, ignore_eos=True))
    sched.step()
    pages = decoder.pages_of_row(req.shadowkv.scratch_row)
    assert len(set(pages)) == decoder.row_pages == tiny_tier.get_server_info()["memory"]["scratch_pages"]
    assert not set(pages) & set(sched.pool.free_ids())
    assert decoder.scratch_pages[req.shadowkv.scratch_row].tolist() == pages  # the kernels' page table
    sched.cache.check_integrity(sched.running)
    sched.pool.free(pages[:1])  # a row's page also on the free list
    with pytest.raises(RuntimeError, match="page"):
        sched.cache.check_integrity(sched.running)
    assert sched.pool.alloc(1) == pages[:1]  # taken back (a LIFO free list): whole again
    while sched.has_work:
        sched.step()
        sched.cache.check_integrity(sched.running)
    assert req.finished and len(req.output_ids) == 8 and decoder.pages_of_row(req.shadowkv.scratch_row) == []
    assert set(pages) <= set(sched.pool.free_ids()) and decoder.free_rows == decoder.max_rows
    assert tiny_tier.get_server_info()["memory"]["scratch_pages"] == 0
    assert tiny_tier.flush_cache() and sched.pool.num_free == sched.pool.capacity - 1  # all but the null page


def test_every_running_request_may_decode_compressed_by_default(tiny_model_path, monkeypatch):
    """Rows cost no memory until taken, so shadowkv_max_requests defaults to --max-running-requests:
    six questions on a compressed document decode together; an explicit limit of two still holds
    (the others wait for a row)."""
    peaks = {}
    for limit in (None, 2):
        with Engine(model_path=tiny_model_path, max_total_tokens=4000, max_running_requests=6,
                    shadowkv_max_requests=limit, **TIER) as engine:
            sched = engine.scheduler
            assert sched.cache.compressed.decoder.max_rows == (limit or 6)
            doc = compressed_document(engine, monkeypatch, 21)
            reqs = [sched.add_request(f"q{i}", doc + question(i + 1), SamplingParams(max_new_tokens=6, ignore_eos=True))
                    for i in range(6)]
            peaks[limit] = 0
            while sched.has_work:
                sched.step()
                peaks[limit] = max(peaks[limit], sum(r.shadowkv is not None for r in sched.running))
                sched.cache.check_integrity(sched.running)
            assert all(r.finished and r.shadowkv.layout is not None for r in reqs)
    assert peaks == {None: 6, 2: 2}


def test_admission_waits_while_the_pool_cannot_hold_a_scratch_row(tiny_tier, monkeypatch):
    """A question on a compressed document needs a scratch row's pages besides its own: while a
    running request has reserved all but a few of the pool's pages it waits (nothing taken), and
    it runs once they are back."""
    sched = tiny_tier.scheduler
    decoder = sched.cache.compressed.decoder
    doc = compressed_document(tiny_tier, monkeypatch, 22)
    spare = decoder.row_pages // 2  # pages left to the question: enough for its own, not for a row
    hog_tokens = (sched.pool.num_free - spare) * sched.page_size  # reserved, never evicting the document
    hog = sched.add_request("hog", question(9), SamplingParams(max_new_tokens=hog_tokens - 12, ignore_eos=True))
    sched.step()
    req = sched.add_request("q", doc + question(1), SamplingParams(max_new_tokens=4, ignore_eos=True))
    for _ in range(4):
        sched.step()
        sched.cache.check_integrity(sched.running)
        assert list(sched.prefill.waiting) == [req] and req.shadowkv is None and req.pool_row is None
        assert decoder.free_rows == decoder.max_rows
    assert sched.abort("hog") and hog.finish_reason["type"] == "abort"
    while sched.has_work:
        sched.step()
        sched.cache.check_integrity(sched.running)
    assert req.finished and len(req.output_ids) == 4 and req.shadowkv.layout is not None
    assert req.cached_tokens >= DOC_TOKENS - 8  # it waited for the compressed document, not around it
    sched.run_when_idle()


def test_a_compressed_document_keeps_its_values_on_the_gpu_while_the_pool_can_spare_pages(tiny_tier, monkeypatch):
    """Compressed with room to spare, a document's values are also copied into pages lent by the
    dense pool; a question on it reads them there (with its host copy spoiled it answers as
    before, and differently once the GPU copy is given back); an allocation that needs the lent
    pages takes them back, and the pool's accounting holds throughout."""
    sched = tiny_tier.scheduler
    tier, store = sched.cache.compressed, sched.cache.compressed.store
    ask = {"max_new_tokens": 8, "temperature": 0}

    def fresh_document(spoil_host: bool):
        """Document 23 compressed again from an empty cache (the same state each time), its segment."""
        doc = compressed_document(tiny_tier, monkeypatch, 23)
        seg = next(iter(store.live.values()))
        assert seg.value_pages and sched.pool.lent == len(seg.value_pages) == store.value_pages_for(seg.num_chunks)
        for layer in range(store.num_layers if spoil_host else 0):
            for first, count, _ in seg.host_runs:
                store.host_v[layer][first:first + count] = 1e4
        return doc, seg

    # the question's prefill over the document's exact copy loaded dense would read the host values
    # this test spoils (the host holds them exactly here): it prefills over its workspace, which
    # reads the GPU copy of the values as decode does
    monkeypatch.setattr(tier, "copies_loaded_dense", False)
    doc, _ = fresh_document(spoil_host=False)
    shadowkv = tiny_tier.get_server_info()["shadowkv"]
    assert shadowkv["gpu_value_loads"] >= 1 and shadowkv["tiers"]["compressed_gpu_value_bytes"] > 0
    want = tiny_tier.generate(input_ids=doc + question(3), sampling_params=ask)["output_ids"]
    doc, _ = fresh_document(spoil_host=True)  # only the GPU copy is right
    assert tiny_tier.generate(input_ids=doc + question(3), sampling_params=ask)["output_ids"] == want
    doc, seg = fresh_document(spoil_host=True)
    drops = tier.counters.gpu_value_drops
    taken = sched.pool.alloc(sched.pool.num_unused + 1)  # one page more than the unused: a loan comes back
    assert tier.counters.gpu_value_drops == drops + 1 and not seg.value_pages and sched.pool.lent == 0
    sched.pool.free(taken)
    sched.run_when_idle()  # the integrity check: whole
    assert tiny_tier.generate(input_ids=doc + question(3), sampling_params=ask)["output_ids"] != want
    sched.run_when_idle()
