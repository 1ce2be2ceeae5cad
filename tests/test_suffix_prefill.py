"""ShadowKV's suffix prefill: questions over a cached compressed document attend every chunk of
it (the default) or their own chunk selection (shadowkv/suffix_prefill.py), alone, together in
one step, aborted midway, and in the server's warmup. A file of its own so that the test workers share the
ShadowKV suites evenly."""

import gc

import pytest

from tests.conftest import assert_pool_clean
from tests.test_shadowkv import (SHADOW_ENGINE, assert_shadow_pools_clean, document_and_questions, greedy_answers,
                                long_prompt, shadow_engine)  # noqa: F401 (a fixture)


SELECTING = {"shadowkv_sparse_prefill_max": 2048}  # suffixes of up to 2048 tokens attend a chunk selection
TRITON_LAYERS = 3  # layers whose exact round also runs the Triton kernels (interpreted)


def suffix_scheduler(shadow_engine, **overrides):
    """A scheduler on the shadow engine's model with other ShadowKV settings."""
    from sglang_shadowkv.model_executor.model_runner import ModelRunner
    from sglang_shadowkv.scheduler.scheduler import Scheduler
    from sglang_shadowkv.server_args import ServerArgs

    args = ServerArgs(**{**SHADOW_ENGINE, **overrides})
    return Scheduler(args, ModelRunner(args, loaded=shadow_engine.scheduler.runner.loaded))


def test_sparse_suffix_prefill_agrees_with_exact_attention_over_the_prefix(shadow_engine):
    """Questions over a compressed document, prefilled sparsely (a chunk selection) and exactly
    (every chunk rebuilt into a workspace, the default): mostly the same greedy
    answers, first tokens included, and the document prefilled and compressed once."""
    doc, questions = document_and_questions(shadow_engine.tokenizer, 1200, 31)
    questions = questions[:3] + [long_prompt(shadow_engine.tokenizer, 150, 32)]  # three tiles of queries
    exact = greedy_answers(suffix_scheduler(shadow_engine, shadowkv_sparse_prefill_max=0), doc, questions, 8)
    sched = suffix_scheduler(shadow_engine, **SELECTING)
    pool = sched.runner.pool
    for buf in pool.k_buffers + pool.v_buffers:  # scratch rows take pages as they are: what was never
        buf.view(pool.num_pages, -1)[pool.free_ids()] = float("nan")  # written is never read
    sparse = greedy_answers(sched, doc, questions, 8)
    assert sched.stats["compressions"] == 1 and sched.stats["compressed_prefix_hits"] == len(questions)
    assert sched.stats["prefill_tokens"] < 1200 + sum(len(q) for q in questions) * 2  # no restore
    agree = sum(a == b for x, y in zip(sparse, exact) for a, b in zip(x, y))
    del sched
    gc.collect()  # the two extra schedulers' pools, before the next test
    # this engine caps the budget at 64 chunks (CI time); at the defaults benchmarks/suffix_fidelity.py
    # measured 288/288 equal tokens on a 5.2K-token memo (results/suffix_fidelity_cpu.json)
    assert agree / sum(map(len, exact)) >= 0.8 and all(x[0] == y[0] for x, y in zip(sparse, exact))


def test_suffixes_prefilled_together_answer_as_one_at_a_time(shadow_engine):
    """A step that prefills several suffixes over the same compressed document (one tile, three
    tiles, and an exact one that asks for prompt logprobs) gives each the tokens it gets alone."""
    from sglang_shadowkv.scheduler.logprobs import LogprobOptions
    from sglang_shadowkv.sampling_params import SamplingParams

    doc, questions = document_and_questions(shadow_engine.tokenizer, 1200, 33)
    questions = questions[:2] + [long_prompt(shadow_engine.tokenizer, 150, 34)]
    sched = suffix_scheduler(shadow_engine, **SELECTING)
    alone = greedy_answers(sched, doc, questions, 6)
    sched.flush_cache()
    greedy_answers(sched, doc, questions[:1], 1)  # the document, compressed
    reqs = [sched.add_request(f"b{i}", doc + q, SamplingParams(max_new_tokens=6, temperature=0))
            for i, q in enumerate(questions)]
    scored = sched.add_request("exact", doc + questions[0], SamplingParams(max_new_tokens=6, temperature=0),
                               LogprobOptions(start_len=len(doc)))
    sched.step()
    assert all(r.prompt_done for r in reqs + [scored]) and scored.shadowkv.exact_prefill  # one step for all
    while sched.has_work:
        sched.step()
    assert [r.output_ids for r in reqs] == alone
    assert scored.output_ids[0] == alone[0][0]
    del sched
    gc.collect()


@pytest.mark.parametrize("copies", [True, False], ids=["from-exact-copies", "rebuilt"])
def test_exact_questions_together_share_one_fetch_and_their_kernels_match_the_reference(shadow_engine, monkeypatch,
                                                                                        copies):
    """Questions attending every chunk (shadowkv_sparse_prefill_max=0) sent together: one round, their
    document fetched once for all three (not once each): gathered from its exact copy (when the
    pool cannot spare the pages to load the copy dense: mem_cache/copy_loads.py), or rebuilt from
    its compressed form; each answering as it does alone. Its Triton
    kernels (interpreted here) give the torch reference's attention output, with the workspace
    cut into pieces of 64 chunk columns (the last one padded)."""
    from sglang_shadowkv.sampling_params import SamplingParams
    from sglang_shadowkv.shadowkv import suffix_prefill

    doc, questions = document_and_questions(shadow_engine.tokenizer, 1200, 37)
    sched = suffix_scheduler(shadow_engine, shadowkv_sparse_prefill_max=0,
                             **({} if copies else {"shadowkv_exact_copy_fraction": 0.0}))
    alone = greedy_answers(sched, doc, questions[:3], 4)
    sched.flush_cache()
    greedy_answers(sched, doc, questions[:1], 1)  # the document, compressed
    suffix = sched.runner.backend.suffix
    plans, gaps, pieces = [], [], []
    fetch_name = "fetch_copies" if copies else "fetch"
    planned, attend, fetch = suffix_prefill.SuffixPrefill.plan, suffix_prefill.SuffixPrefill.attend, getattr(
        suffix.decoder, fetch_name)

    def both_paths(self, q, layer, plan, kv_pool):
        """The reference's output, after the Triton kernels' on the same inputs (the first
        TRITON_LAYERS layers: the interpreter takes seconds a layer)."""
        if layer >= TRITON_LAYERS:
            return attend(self, q, layer, plan, kv_pool)
        self.use_triton = self.decoder.use_triton = True
        got = attend(self, q, layer, plan, kv_pool)
        self.use_triton = self.decoder.use_triton = False
        ref = attend(self, q, layer, plan, kv_pool)
        gaps.append(float((got - ref).abs().max()))
        return ref

    monkeypatch.setattr(suffix_prefill.SuffixPrefill, "plan", lambda self, *a: plans.append(planned(self, *a))
                        or plans[-1])
    monkeypatch.setattr(suffix_prefill.SuffixPrefill, "attend", both_paths)
    monkeypatch.setattr(suffix.decoder, fetch_name, lambda jobs, *a, **k: pieces.append(jobs.shape) or fetch(jobs, *a, **k))
    monkeypatch.setattr(suffix_prefill, "WORKSPACE_BYTES", 64 * 2 * 3 * 8 * 64 * 4 + 1)  # 64 columns of float32 chunks
    monkeypatch.setattr(sched.cache.compressed, "headroom", lambda: 0)  # no page to spare for a dense load
    reqs = [sched.add_request(f"x{i}", doc + q, SamplingParams(max_new_tokens=4, temperature=0))
            for i, q in enumerate(questions[:3])]
    sched.step()
    monkeypatch.setattr(suffix_prefill.SuffixPrefill, "attend", attend)
    monkeypatch.setattr(suffix.decoder, fetch_name, fetch)
    while sched.has_work:
        sched.step()
    assert [r.output_ids for r in reqs] == alone
    (plan,) = plans
    (rnd,) = plan.rounds
    ws = rnd.workspace
    assert ws.slots.shape[0] == 1 and ws.docs.tolist() == [0, 0, 0] and ws.width == 64 and ws.from_copies == copies
    assert sched.stats["exact_copy_hits"] == (len(alone) + 1 + len(reqs) if copies else 0)  # every question
    assert sched.stats["dense_copy_prefills"] == (len(alone) + 1 if copies else 0)  # but the three together
    layers = sched.runner.config.num_layers
    assert len(gaps) == TRITON_LAYERS and max(gaps) < 1e-4
    assert len(pieces) == (layers + TRITON_LAYERS) * ws.slots.shape[1] // 64 > layers + TRITON_LAYERS
    assert {p[2] for p in pieces} == {64}
    del sched
    gc.collect()


def test_exact_copies_go_least_recently_used_first_and_a_question_without_one_reads_the_compressed_form(
        shadow_engine):
    """Copies of one document's chunks (1024 tokens): a second document compressed takes the first's
    copy, and a question on the first then prefills over its compressed form, answering as an
    engine without copies does; the second's question reads its copy (counters)."""
    from sglang_shadowkv.sampling_params import SamplingParams

    sched = suffix_scheduler(shadow_engine, shadowkv_exact_copy_fraction=0.125)  # a quarter of 4096 host tokens
    assert sched.runner.compressed_pool.copies.capacity == 1024 // 8
    first, questions = document_and_questions(shadow_engine.tokenizer, 1200, 51)
    second, _ = document_and_questions(shadow_engine.tokenizer, 1200, 52)
    greedy_answers(sched, first, questions[:1], 2)  # compressed, then a question reading its copy
    greedy_answers(sched, second, questions[:1], 2)
    assert sched.stats["exact_copy_hits"] == 2

    def answer(scheduler, ids):
        req = scheduler.add_request("q", ids, SamplingParams(max_new_tokens=6, temperature=0))
        while scheduler.has_work:
            scheduler.step()
        assert req.shadowkv.layout is not None  # a hit on the compressed document
        return req.output_ids

    without_copy = answer(sched, first + questions[1])
    assert sched.stats["exact_copy_hits"] == 2
    no_copies = suffix_scheduler(shadow_engine, shadowkv_exact_copy_fraction=0.0)
    greedy_answers(no_copies, first, questions[:1], 2)
    assert answer(no_copies, first + questions[1]) == without_copy
    answer(sched, second + questions[1])
    assert sched.stats["exact_copy_hits"] == 3
    copies = sched.runner.compressed_pool.copies
    assert [seg.num_chunks for seg in copies.holders()] == [1024 // 8]  # the second document's
    sched.flush_cache()
    assert copies.free_chunks == copies.capacity and not copies.holders()
    del sched, no_copies
    gc.collect()


def test_warm_up_runs_a_compression_and_a_suffix_prefill_and_leaves_no_trace(shadow_engine, monkeypatch):
    """The GPU server's warmup (run here on the CPU): every kind of ShadowKV step once (a suffix a
    graph holds and one longer than any: the eager step's kernels), then the cache, the pools and
    the counters as they were."""
    from sglang_shadowkv.scheduler.warmup import warm_up
    from sglang_shadowkv.shadowkv import suffix_prefill

    shadow_engine.flush_cache()
    sched = shadow_engine.scheduler
    before = dict(sched.stats)
    steps = sched.runner.eager_steps
    suffixes, plan = [], suffix_prefill.SuffixPrefill.plan

    def record(self, table, reqs, q_starts):
        suffixes.extend(r.seq_len - r.start for r in reqs)
        return plan(self, table, reqs, q_starts)

    monkeypatch.setattr(suffix_prefill.SuffixPrefill, "plan", record)
    warm_up(sched)
    assert sched.runner.eager_steps > steps and dict(sched.stats) == before
    longest = suffix_prefill.GRAPH_TOKENS[-1]
    assert any(n <= longest for n in suffixes) and any(n > longest for n in suffixes)
    assert_pool_clean(shadow_engine)
    assert_shadow_pools_clean(shadow_engine)


def test_abort_during_a_suffix_prefill_frees_everything(shadow_engine):
    from sglang_shadowkv.sampling_params import SamplingParams

    shadow_engine.flush_cache()
    doc, questions = document_and_questions(shadow_engine.tokenizer, 1200, 25)
    shadow_engine.generate(input_ids=doc + questions[0], sampling_params={"max_new_tokens": 2, "temperature": 0})
    sched = shadow_engine.scheduler
    long_suffix = long_prompt(shadow_engine.tokenizer, 700, 26)  # two prefill chunks of 512
    req = sched.add_request("suffix", doc + long_suffix, SamplingParams(max_new_tokens=8))
    sched.step()
    assert req.shadowkv.layout is not None and not req.prompt_done  # over the document, the suffix half done
    assert sched.abort("suffix")
    assert_pool_clean(shadow_engine)
    assert_shadow_pools_clean(shadow_engine)


def test_eager_rounds_are_padded_to_the_widths_the_server_compiles(shadow_engine, monkeypatch):
    """Suffixes of any length (here 5, 70 and 150 queries, prefilled together) run their tiles at
    the two widths the warmup and graphs compile (16 or 64 queries) over chunk columns padded to a
    multiple of 16, and answer as each does alone: on the H100 every other width compiled kernel
    variants of its own in a user's step (22 during a chat over 32K documents)."""
    from sglang_shadowkv.sampling_params import SamplingParams
    from sglang_shadowkv.shadowkv import suffix_prefill

    doc, _ = document_and_questions(shadow_engine.tokenizer, 1200, 35)
    questions = [long_prompt(shadow_engine.tokenizer, n, 36 + n) for n in (5, 70, 150)]
    sched = suffix_scheduler(shadow_engine, **SELECTING)
    alone = greedy_answers(sched, doc, questions, 4)
    plans = []
    planned = suffix_prefill.SuffixPrefill.plan
    monkeypatch.setattr(suffix_prefill.SuffixPrefill, "plan", lambda self, *a: plans.append(planned(self, *a))
                        or plans[-1])
    sched.flush_cache()
    greedy_answers(sched, doc, questions[:1], 1)  # the document, compressed
    reqs = [sched.add_request(f"w{i}", doc + q, SamplingParams(max_new_tokens=4, temperature=0))
            for i, q in enumerate(questions)]
    while sched.has_work:
        sched.step()
    assert [r.output_ids for r in reqs] == alone
    rounds = [rnd for plan in plans for rnd in plan.rounds]
    widths = sorted(rnd.q_index.shape[1] for rnd in rounds)
    assert widths and set(widths) <= {16, 64} and 16 in widths  # 5 queries, 70 % 64 and 150 % 64 pad to 16
    assert all(rnd.chunk_slots.shape[1] % 16 == 0 for rnd in rounds)
    assert sum(int(rnd.q_valid.sum()) for rnd in rounds) >= sum(len(q) for q in questions)  # every query, once
    del sched
    gc.collect()
