"""ShadowKV's choice of a document's tier by cost (scheduler/tier_choice.py): the rule on constructed
cases, the rates it reads, and the scheduler following it on the tiny model (small pools force the
pressure; rates are pinned so that the expected choice is plain): to the host tier when a reload is
cheaper, compressed when it is not or the host cannot take it, and compressed without pressure when
the decode rows reading a document save more than compressing it costs."""

import pytest

from sglang_shadowkv import Engine
from sglang_shadowkv.model_executor.forward_batch import StepItem
from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.scheduler import demotion
from sglang_shadowkv.scheduler.request import Req
from sglang_shadowkv.scheduler.tier_choice import (COMPRESSED_NO_ROOM, COMPRESSED_SPARSE_CHEAPER, PCIE_BYTES_PER_S,
                                                   REASONS, TO_HOST, Average, DecodeFit, Rates, decode_pays,
                                                   decode_reads, leave_gpu, remaining_steps, sparse_row_cost)
from sglang_shadowkv.shadowkv.request_state import CompressedLayout, ShadowKVReqState
from test_tiering import DOC_TOKENS, GREEDY, TIER, document, question

KV = 128 * 1024  # bytes per token of the 8B shape


def rates(pcie=50e9, prefill=20_000.0, answer=100.0, per_token=4e-8, sparse_row=1e-3, sparse_step=0.0) -> Rates:
    """Rates as if measured: a decode row reads a dense token in per_token seconds, a sparse row
    costs sparse_row seconds, and a step with sparse rows sparse_step seconds more."""
    r = Rates.priors(KV, 16 * 10**9)
    r.pcie_bytes_per_s, r.prefill.value, r.answer.value = pcie, prefill, answer
    r.decode.coefficients = [5e-3, per_token, sparse_row, sparse_step]
    return r


# ---- the rule --------------------------------------------------------------------------------------
def test_without_a_host_tier_a_document_under_pressure_is_compressed():
    assert leave_gpu(16384, rates(pcie=1e15), host_tier=False, sparse_running=0) == COMPRESSED_NO_ROOM


def test_a_short_document_with_short_answers_goes_to_the_host():
    # 4K tokens: reload 0.5 GB at 50 GB/s = 10 ms; compressed costs 20 ms of compression and 10 steps
    # a sparse row dearer than reading 4K tokens dense (1 ms against 0.16 ms)
    assert leave_gpu(4096, rates(answer=10, prefill=20_000.0), host_tier=True, sparse_running=0) == TO_HOST


def test_a_long_document_read_by_long_answers_is_compressed_rather_than_reloaded():
    # 128K tokens: reload 0.34 s, then 1000 steps reading 5.2 ms dense; compressed: 0.66 s once and
    # 1 ms a step
    assert leave_gpu(131072, rates(answer=1000), host_tier=True, sparse_running=0) == COMPRESSED_SPARSE_CHEAPER


def test_before_any_measurement_a_16k_document_with_short_answers_goes_to_the_host():
    """The priors alone (a sparse row as dear as a dense 16K row): a 16K document of the 8B shape
    reloads in 40 ms, less than compressing it (70 ms), so short answers leave it exact (H100,
    many_16k: compressing these ran 0.93x of full attention with the host tier)."""
    r = Rates.priors(KV, 16 * 10**9)
    r.answer.value = 32.0
    assert r.reload_s(16384) < r.compression_s(16384)
    assert leave_gpu(16384, r, host_tier=True, sparse_running=0) == TO_HOST


def test_a_slow_link_makes_compression_the_cheaper_way_back():
    assert leave_gpu(4096, rates(answer=10, pcie=1e8), host_tier=True, sparse_running=0) == COMPRESSED_SPARSE_CHEAPER


def test_a_tie_goes_to_the_host_which_is_exact():
    r = rates(answer=0, prefill=1.0)
    r.pcie_bytes_per_s = KV * 1000 / (r.compression_s(1000))  # reload and compression cost the same
    assert r.reload_s(1000) == pytest.approx(r.compression_s(1000))
    assert leave_gpu(1000, r, host_tier=True, sparse_running=0) == TO_HOST


def test_decode_pays_for_a_long_document_read_by_many_rows():
    # 64K tokens: each row step saves 2.6 ms - 1 ms; 8 rows x 500 steps save 6.5 s, compression 0.16 s
    r = rates()
    assert decode_pays(65536, [500] * 8, r, sparse_running=0)
    assert not decode_pays(65536, [20], r, sparse_running=8)  # one row, 20 steps: 32 ms saved, less than compressing
    assert not decode_pays(16384, [1000] * 32, r, sparse_running=8)  # a sparse row dearer than 16K dense: never
    assert not decode_pays(65536, [], r, sparse_running=0)


def test_a_sparse_row_bears_its_share_of_the_sparse_path_of_a_step():
    """Four rows of a 32K document with 64 steps left would save 0.66 ms a step each on their own
    reads (1.31 ms dense against a 16K-token sparse row): 168 ms, more than compressing (82 ms at
    40K prefill tokens a second). But the step runs the sparse path (3.9 ms, 96K tokens' worth)
    for whatever rows decode sparse: four rows alone bear it all and it does not pay (H200,
    shared_32k: such documents were compressed and the run was 0.945x of full attention); beside
    28 rows decoding sparse already, or as 16 rows, it does."""
    r = rates(prefill=40_000.0, per_token=4e-8, sparse_row=16384 * 4e-8, sparse_step=98304 * 4e-8)
    assert sparse_row_cost(r, 1) == pytest.approx(r.sparse_row_s + r.sparse_step_s)
    assert sparse_row_cost(r, 4) == pytest.approx(r.sparse_row_s + r.sparse_step_s / 4)
    assert not decode_pays(32768, [64] * 4, r, sparse_running=0)
    assert decode_pays(32768, [64] * 4, r, sparse_running=28)
    assert decode_pays(32768, [64] * 16, r, sparse_running=0)
    # the priors alone say the same: a sparse row is a dense read of 16K tokens, the path of 96K
    prior = Rates.priors(KV, 16 * 10**9)
    assert prior.sparse_row_s / prior.dense_row_s(16384) == pytest.approx(1.0)
    assert prior.sparse_step_s / prior.dense_row_s(98304) == pytest.approx(1.0)
    assert not decode_pays(32768, [64] * 4, prior, sparse_running=0)
    assert decode_pays(32768, [64] * 16, prior, sparse_running=28)


def test_under_pressure_few_sparse_rows_send_a_short_answered_document_to_the_host():
    """The rates the H100 measured on many_16k (16K documents, 32-token answers): a sparse row 0.39
    ms against 1.16 ms dense, the sparse path 6.8 ms a step. Reloading a document (41 ms) and
    reading it dense (37 ms) cost less than compressing it (34 ms) while the steps have few
    sparse rows to share the path (it went compressed 22 times, and the run was 0.97x); beside
    many sparse rows compression is the cheaper way."""
    r = rates(pcie=53e9, prefill=48_540.0, answer=32.0, per_token=7.05e-8, sparse_row=3.9e-4, sparse_step=6.75e-3)
    assert leave_gpu(16384, r, host_tier=True, sparse_running=0) == TO_HOST
    assert leave_gpu(16384, r, host_tier=True, sparse_running=4) == TO_HOST
    assert leave_gpu(16384, r, host_tier=True, sparse_running=12) == COMPRESSED_SPARSE_CHEAPER


def test_a_move_that_would_push_documents_out_of_a_full_host_tier_pays_their_prefill():
    """The rates the H100 measured on many_16k with this charge missing (16K documents, 32-token
    answers): the host tier had filled, 56 documents went there anyway and pushed 267K tokens out,
    which were prefilled again (0.86x of full attention). Into free room the host stays cheaper;
    displacing a document of the same size costs its prefill (0.47 s), and compression wins."""
    r = rates(pcie=53e9, prefill=34_977.0, answer=32.0, per_token=5.28e-8, sparse_row=5.48e-4, sparse_step=9.1e-3)
    assert leave_gpu(16384, r, host_tier=True, sparse_running=0) == TO_HOST
    assert leave_gpu(16384, r, host_tier=True, sparse_running=0, displaced=0) == TO_HOST
    assert leave_gpu(16384, r, host_tier=True, sparse_running=0, displaced=16384) == COMPRESSED_SPARSE_CHEAPER
    assert r.prefill_s(16384) == pytest.approx(16384 / 34_977.0)


def test_remaining_steps_are_an_answer_at_most_what_max_new_tokens_leaves():
    r = rates(answer=100)
    req = Req("r", [1] * 50, SamplingParams(max_new_tokens=300))
    req.max_total_len, req.num_sampled = 350, 10
    assert remaining_steps(req, r) == 100
    req.num_sampled = 260
    assert remaining_steps(req, r) == 40


# ---- the rates -------------------------------------------------------------------------------------
def test_an_average_starts_at_its_prior_and_follows_measurements():
    avg = Average(100.0)
    avg.add(200.0)
    assert avg.value == 150.0  # the prior counts as one measurement
    for _ in range(200):
        avg.add(10.0)
    assert avg.value == pytest.approx(10.0, rel=1e-3)


def test_rates_follow_what_the_scheduler_measures():
    r = Rates.priors(KV, 10**9)
    r.observe_prefill(2.0, 4000)
    assert r.prefill.value < 23_000  # half the prior and 2000 tokens/s
    r.observe_host_loads(10 * 10**9, 1000)
    assert r.pcie_bytes_per_s == 10e9
    r.observe_host_loads(10 * 10**9, 1)  # issue time, not a link's: capped at the measured link
    assert r.pcie_bytes_per_s == PCIE_BYTES_PER_S


def test_time_spent_loading_nothing_is_no_measurement_of_the_link():
    """Served on the H100: milliseconds counted while no byte had come back made the rate zero, and
    the next document under pressure divided by it (the scheduler step failed, its requests aborted)."""
    r = Rates.priors(KV, 10**9)
    r.observe_host_loads(0, 201)
    assert r.pcie_bytes_per_s == PCIE_BYTES_PER_S
    assert leave_gpu(16384, r, host_tier=True, sparse_running=0) in (TO_HOST, COMPRESSED_SPARSE_CHEAPER)
    r.observe_answer(28)
    assert r.answer.value == 78.0
    assert set(r.as_dict()) >= {"prefill_tokens_per_s", "pcie_bytes_per_s", "answer_tokens", "sparse_row_s",
                                "sparse_step_s"}


def test_the_decode_fit_separates_a_row_read_from_the_step_and_keeps_unseen_priors():
    base, per_token, sparse_row, sparse_step = 4e-3, 2e-8, 6e-4, 2e-3
    fit = DecodeFit((1e-3, 1e-8, 1e-3, 1e-3))
    for step in range(300):
        dense, sparse = 20000 + 7919 * step % 200_000, step % 5
        fit.add(base + dense * per_token + sparse * sparse_row + (sparse > 0) * sparse_step, dense, sparse)
    assert fit.coefficients == pytest.approx([base, per_token, sparse_row, sparse_step], rel=0.1)
    dense_only = DecodeFit((1e-3, 1e-8, 1e-3, 4e-3))
    for step in range(50):
        dense_only.add(2e-3 + (1000 + 100 * step) * 3e-8, 1000 + 100 * step, 0)
    assert dense_only.coefficients[1] > 1.5e-8  # toward the measured 3e-8
    # no sparse row seen: their priors, scaled as the dense read's was
    scale = dense_only.coefficients[1] / 1e-8
    assert dense_only.coefficients[2] / 1e-3 == pytest.approx(scale)
    assert dense_only.coefficients[3] / 4e-3 == pytest.approx(scale)


def test_decode_reads_count_a_sparse_row_by_its_dense_window():
    layout = CompressedLayout(*[None] * 4, dense_spans=[(0, 16)], compressed_end=512)
    items = [StepItem(0, [], 99), StepItem(1, [], 599, ShadowKVReqState(0, layout=layout))]
    assert decode_reads(items) == (100 + 16 + 600 - 512, 1)


# ---- the scheduler follows it ----------------------------------------------------------------------
def pin(engine, monkeypatch, **values) -> Rates:
    """The engine's rates set to `rates(**values)` and kept there (nothing measured meanwhile)."""
    r = engine.scheduler.cache.rates
    fixed = rates(**values)
    r.pcie_bytes_per_s, r.prefill.value = fixed.pcie_bytes_per_s, fixed.prefill.value
    r.answer.value = fixed.answer.value
    r.decode.coefficients = fixed.decode.coefficients
    for name in ("observe_prefill", "observe_decode", "observe_host_loads", "observe_answer"):
        monkeypatch.setattr(r, name, lambda *args: None)
    return r


def reasons(engine) -> dict:
    info = engine.get_server_info()
    return {name: info["shadowkv"][name] for name in (*REASONS, "demotions", "rows_made_sparse")}


@pytest.fixture(scope="module")
def tiered_host(tiny_model_path):
    """Three of the 600-token documents dense on the GPU, a host tier twice as large."""
    with Engine(model_path=tiny_model_path, max_total_tokens=2400, enable_hierarchical_cache=True, **TIER) as engine:
        yield engine


def four_documents(engine) -> list[list[int]]:
    """Four documents through a pool that holds three dense: their answers."""
    engine.flush_cache()
    return [engine.generate(input_ids=document(i) + question(i), sampling_params=GREEDY)["output_ids"]
            for i in range(4)]


def test_under_pressure_a_document_goes_to_the_host_when_a_reload_is_cheaper(tiered_host, monkeypatch):
    pin(tiered_host, monkeypatch, pcie=1e15, answer=4)
    before = reasons(tiered_host)
    cold = four_documents(tiered_host)
    after = reasons(tiered_host)
    assert after[TO_HOST] - before[TO_HOST] >= 1 and after["demotions"] == before["demotions"]
    loaded = tiered_host.get_server_info()["stats"]["host_hit_tokens"]
    hit = tiered_host.generate(input_ids=document(0) + question(0), sampling_params=GREEDY)  # the oldest
    assert hit["output_ids"] == cold[0]  # exact: loaded back dense
    assert hit["meta_info"]["cached_tokens"] >= DOC_TOKENS - 8
    assert tiered_host.get_server_info()["stats"]["host_hit_tokens"] - loaded >= 512


def test_under_pressure_a_document_is_compressed_when_a_reload_costs_more(tiered_host, monkeypatch):
    pin(tiered_host, monkeypatch, pcie=1e3)
    before = reasons(tiered_host)
    four_documents(tiered_host)
    after = reasons(tiered_host)
    assert after[COMPRESSED_SPARSE_CHEAPER] - before[COMPRESSED_SPARSE_CHEAPER] >= 1
    assert after[TO_HOST] == before[TO_HOST]
    hit = tiered_host.generate(input_ids=document(0) + question(7), sampling_params=GREEDY)
    assert hit["meta_info"]["shadowkv"]["compressed_tokens"] >= 512  # it hit the compressed document


def test_a_host_tier_too_small_for_the_document_leaves_it_compressed(tiny_model_path, monkeypatch):
    with Engine(model_path=tiny_model_path, max_total_tokens=2400, enable_hierarchical_cache=True,
                hicache_ratio=0.2, **TIER) as engine:  # 480 host tokens: no 600-token document fits
        pin(engine, monkeypatch, pcie=1e15, answer=4)
        four_documents(engine)
        got = reasons(engine)
        assert got[COMPRESSED_NO_ROOM] >= 1 and got[TO_HOST] == 0 and got["demotions"] == got[COMPRESSED_NO_ROOM]


def test_a_full_host_tier_takes_no_document_that_would_push_another_out(tiny_model_path, monkeypatch):
    with Engine(model_path=tiny_model_path, max_total_tokens=2400, enable_hierarchical_cache=True,
                hicache_ratio=0.3, **TIER) as engine:  # 720 host tokens: one 600-token document
        pin(engine, monkeypatch, pcie=1e15, answer=4)  # into free room a reload is cheaper
        cold = [engine.generate(input_ids=document(i) + question(i), sampling_params=GREEDY)["output_ids"]
                for i in range(6)]  # through a pool that holds three dense
        got = reasons(engine)
        assert got[TO_HOST] == 1 and got[COMPRESSED_SPARSE_CHEAPER] >= 1
        assert engine.get_server_info()["stats"]["host_evicted_tokens"] == 0  # nothing pushed out
        hit = engine.generate(input_ids=document(0) + question(0), sampling_params=GREEDY)  # the one on the host
        assert hit["output_ids"] == cold[0] and hit["meta_info"]["cached_tokens"] >= DOC_TOKENS - 8


@pytest.fixture(scope="module")
def roomy(tiny_model_path):
    """Every document fits dense: no pressure."""
    with Engine(model_path=tiny_model_path, max_total_tokens=8000, **TIER) as engine:
        yield engine


@pytest.mark.parametrize("pays", [True, False])
def test_without_pressure_a_document_read_by_decode_rows_is_compressed_when_sparse_decode_pays(
        roomy, monkeypatch, pays):
    """Two rows decode over a cached dense document. When the rule says sparse decode pays, it is
    compressed while they run and they switch to sparse decode over it (each takes a scratch row);
    when it does not, it stays dense."""
    monkeypatch.setattr(demotion, "DECODE_PAYS_EVERY", 1)
    monkeypatch.setattr(demotion, "TOKEN_LAYERS_PER_STEP", 1)  # a layer a step: the rows decode meanwhile
    pin(roomy, monkeypatch)  # sparse decode never pays for 600 tokens
    sched = roomy.scheduler
    roomy.flush_cache()
    roomy.generate(input_ids=document(50) + question(0), sampling_params=GREEDY)  # cached dense
    if pays:
        pin(roomy, monkeypatch, per_token=1e-2, sparse_row=1e-6)
    before = reasons(roomy)
    reqs = [sched.add_request(f"q{i}", document(50) + question(i + 1),
                              SamplingParams(max_new_tokens=12, ignore_eos=True)) for i in range(2)]
    sparse_while_running = False
    while sched.has_work:
        sched.step()
        sched.cache.check_integrity(sched.running)
        sparse_while_running |= any(r.over_compressed_prefix and not r.finished for r in reqs)
    after = reasons(roomy)
    assert all(r.finished and len(r.output_ids) == 12 for r in reqs)
    assert after["compressed_decode_pays"] - before["compressed_decode_pays"] == int(pays)
    assert after["rows_made_sparse"] - before["rows_made_sparse"] == (2 if pays else 0)
    assert sparse_while_running == pays and (sched.cache.tree.total_chunks > 0) == pays
    assert pays == all(r.shadowkv_info is not None and r.shadowkv_info["compressed_tokens"] >= 512 for r in reqs)
    sched.run_when_idle()


def test_the_warmup_leaves_the_rates_as_they_were(roomy):
    """The warmup's steps compile kernels: what they take is no measure of serving."""
    from sglang_shadowkv.scheduler.warmup import warm_up

    rates = roomy.scheduler.cache.rates
    before = rates.as_dict()
    warm_up(roomy.scheduler)
    assert rates.as_dict() == before and roomy.scheduler.step_times.rates is rates
