"""ShadowKV compression, configuration and the engine's attention="shadowkv" path (CPU); the
sparse suffix prefill's tests are in test_suffix_prefill.py."""

import pytest
import torch

from sglang_shadowkv.shadowkv.compress import chunk_landmarks, low_rank_basis, outlier_chunks
from sglang_shadowkv.shadowkv.config import ShadowKVConfig
from tests.conftest import assert_pool_clean

SENTENCES = [
    "The river town kept its records in a stone archive near the old mill.",
    "Every spring the council met to count the boats and repair the bridge.",
    "Merchants arrived from the coast with salt, cloth and news of distant wars.",
    "Children learned to read from the ledgers their grandparents had written.",
    "In the dry years the farmers dug new channels from the hills to the fields.",
    "A traveller once wrote that the town smelled of bread, tar and wet wool.",
]


def long_prompt(tokenizer, num_tokens: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    order = torch.randint(0, len(SENTENCES), (num_tokens // 8,), generator=gen).tolist()
    text = " ".join(SENTENCES[i] for i in order) + "\nQuestion: what did the merchants bring? Answer:"
    return tokenizer.encode(text, add_special_tokens=False)[-num_tokens:]


@pytest.mark.parametrize("method", ["eigh", "subspace", "auto"])
def test_gram_methods_reconstruct_as_well_as_the_svd(method):
    gen = torch.Generator().manual_seed(0)
    spectrum = torch.logspace(1, -6, 128)
    x = torch.randn(2000, 128, generator=gen) * spectrum  # columns of decaying scale
    x = x @ torch.linalg.qr(torch.randn(128, 128, generator=gen))[0]
    b_gram, b_svd = low_rank_basis(x, 16, method=method), low_rank_basis(x, 16, method="svd")
    assert b_gram.shape == b_svd.shape == (16, 128)
    torch.testing.assert_close(b_gram @ b_gram.T, torch.eye(16), atol=1e-4, rtol=0)
    rec_gram, rec_svd = x @ b_gram.T @ b_gram, x @ b_svd.T @ b_svd
    err_gram, err_svd = (x - rec_gram).norm() / x.norm(), (x - rec_svd).norm() / x.norm()
    assert err_svd < 0.2 and (x - x @ b_svd[:8].T @ b_svd[:8]).norm() / x.norm() > err_svd  # rank matters
    if method == "subspace":  # a fixed-rank block, no Rayleigh-Ritz: near-optimal, not the same span
        assert err_gram <= 1.01 * err_svd
    else:
        assert (rec_gram - rec_svd).norm() / x.norm() < 1e-3


def test_subspace_iteration_survives_rank_deficient_keys():
    x = torch.zeros(300, 96)
    x[:, :3] = torch.randn(300, 3, generator=torch.Generator().manual_seed(3))
    b = low_rank_basis(x, 24, method="subspace")
    assert b.isfinite().all() and b.shape == (24, 96)
    torch.testing.assert_close(x @ b.T @ b, x, atol=1e-4, rtol=0)
    norms = (b * b).sum(1)  # three unit rows; the rest, beyond the true rank, zero
    torch.testing.assert_close(norms, (torch.arange(24) < 3).float(), atol=1e-4, rtol=0)


def test_energy_rule_picks_the_true_rank():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(500, 5, generator=gen) @ torch.randn(5, 48, generator=gen)
    x += 1e-4 * torch.randn(500, 48, generator=gen)
    assert low_rank_basis(x, 48, energy=0.9999).shape[0] == 5
    assert low_rank_basis(x, 3, energy=0.9999).shape[0] == 3  # capped
    assert low_rank_basis(x, 8, energy=0.9999, method="subspace").shape[0] == 5


def _compressed_pool(num_pages=64, host_chunks=12, value_dtype=None, landmark_dtype=None, copy_chunks=0):
    """A compressed pool inside a dense pool of its own: 1 layer, 2 KV heads of 8 dims, chunks of 4."""
    from sglang_shadowkv.mem_cache.compressed_pool import ShadowKVPool
    from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool

    kv = PagedKVPool(num_pages, 4, 1, 2, 8, torch.float32, "cpu")
    return ShadowKVPool(kv, 4, host_chunks, 3, value_dtype=value_dtype, landmark_dtype=landmark_dtype,
                        copy_chunks=copy_chunks)


def test_segments_take_their_pages_from_the_dense_pool_and_give_them_back():
    pool = _compressed_pool()
    kv, free = pool.kv, pool.kv.num_free
    first = pool.alloc_segment(0, 16, 1)
    second = pool.alloc_segment(0, 12, 1)
    assert kv.num_free == free - pool.pages_for(4, 1) - pool.pages_for(3, 1)
    assert not set(first.pages) & set(second.pages) and pool.null_page not in first.pages + second.pages
    assert (pool.selectable[0][pool.null_slot] == 0).all()  # the padding slot: never selectable
    pool.free_segment(first)
    third = pool.alloc_segment(0, 24, 1)  # the freed host slots, then fresh ones: two runs
    for seg in (second, third):
        covered = [first_slot + i for first_slot, count, _ in seg.host_runs for i in range(count)]
        assert covered == seg.host_slots
        assert pool.host_slot[seg.chunk_slots].tolist() == seg.host_slots
    assert len(third.host_runs) == 2
    values = torch.randn(6, 2, 4, 8)
    pool.write_host_values(0, third, values.transpose(1, 2).reshape(24, 2, 8))  # given token-major
    torch.testing.assert_close(pool.host_v[0][third.host_slots], values)
    torch.testing.assert_close(pool.read_host_values(0, third, 1, 4), values[1:5])
    assert pool.alloc_segment(0, 28, 1) is None  # 7 chunks: the host pool has 3 left
    for seg in (second, third):
        pool.free_segment(seg)
    assert kv.num_free == free and pool.free_chunks == pool.chunk_capacity


@pytest.mark.parametrize("use_triton", [False, True], ids=["torch", "triton"])
def test_exact_copies_keep_the_most_recently_used_segments_and_give_back_their_keys_and_values(use_triton):
    """The copies are a cache: a new segment takes room from the least recently used copies (never
    from those a request is about to read), and its chunks' exact keys and values come back from
    them as written, beside int8 host values (the gather kernel interpreted, or its reference)."""
    from sglang_shadowkv.layers.rotary import RotaryEmbedding
    from sglang_shadowkv.shadowkv.decode import ChunkMemory, SparseDecoder

    pool = _compressed_pool(value_dtype=torch.int8, copy_chunks=8)
    copies = pool.copies
    assert copies.v is not None and copies.capacity == 8  # int8 host values: the copies hold values too
    compressing, older = pool.alloc_segment(0, 8, 1), pool.alloc_segment(0, 16, 1)
    older.last_use = 1  # `compressing` is not done yet: never used (0), its copy goes last
    assert copies.free_chunks == 2
    newer = pool.alloc_segment(0, 12, 1)  # the least recently used copy goes
    assert not older.copy_slots and (copies.slot_of[older.chunk_slots] == 0).all()
    assert len(compressing.copy_slots) == 2 and copies.slot_of[newer.chunk_slots].tolist() == newer.copy_slots
    for seg in (older, compressing):
        pool.free_segment(seg)
    third = pool.alloc_segment(0, 12, 1)
    assert copies.free_chunks == 2 and copies.slot_of[third.chunk_slots].tolist() == third.copy_slots
    kept = pool.alloc_segment(0, 16, 1, keep_copies=[newer, third])  # room only by dropping those
    assert not kept.copy_slots and len(newer.copy_slots) == len(third.copy_slots) == 3
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(12, 2, 8, generator=gen), torch.randn(12, 2, 8, generator=gen)
    pool.write_exact_copy(0, third, keys, values)
    pool.write_host_values(0, third, values)
    decoder = SparseDecoder(pool, ShadowKVConfig(chunk_size=4), RotaryEmbedding(8, 10000.0, 64), 1, 8, use_triton)
    blocks = [torch.zeros(2 * 4 * 2, 4, 8) for _ in range(2)]  # two pages of 4 entries, 2 KV heads
    memory = ChunkMemory(*blocks, torch.arange(8, dtype=torch.int32).view(2, 4))
    jobs = torch.full((2, 2, 4), -1, dtype=torch.int64)
    jobs[0, :, :3] = third.chunk_slots  # row 0 takes the segment's 3 chunks, each KV head
    decoder.fetch_copies(jobs, 0, torch.arange(2, dtype=torch.int32), memory)
    blocks_k, blocks_v = (b.view(2, 4, 2, 4, 8)[0, :3] for b in (memory.blocks_k, memory.blocks_v))  # [entry, head, c, D]
    for got, want in ((blocks_k, keys), (blocks_v, values)):  # exactly as written, not int8-rounded
        assert torch.equal(got, want.view(3, 4, 2, 8).transpose(1, 2))
    for seg in (newer, third, kept):
        pool.free_segment(seg)
    assert copies.free_chunks == 8 and not copies.holders()


def test_compressed_state_lives_in_the_pages_of_the_dense_pool():
    """Low-rank rows, bases, landmarks and outliers written through the pool are read back
    through it, and they are bytes of the dense pool's own K/V buffers."""
    pool = _compressed_pool()
    seg = pool.alloc_segment(0, 20, 2)
    rows, basis = torch.randn(20, 4), torch.randn(4, 16)
    pool.write_lowrank(0, seg, rows)
    pool.write_basis(0, seg, basis)
    got_rows = torch.cat([pool.a_lo[0][seg.chunk_slots], pool.a_hi[0][seg.chunk_slots]], 2)
    torch.testing.assert_close(got_rows, rows.view(5, 4, 4))
    k_pages, v_pages, table = pool.basis_memory(0)
    pages = table[seg.seg_id].long()
    torch.testing.assert_close(torch.stack([k_pages[pages], v_pages[pages]], 1).flatten(0, 2)[:4], basis)
    kv = pool.kv
    before = kv.k_buffers[0].clone()
    pool.write_lowrank(0, seg, rows + 1)
    bits = kv.k_buffers[0].view(torch.int32) != before.view(torch.int32)  # bitwise: the pool is uninitialized
    changed = bits.flatten(1).any(1).view(-1, 4).any(1).nonzero().flatten().tolist()
    assert set(changed) <= set(seg.pages)  # only the segment's own pages


def test_int8_values_and_landmarks_round_trip_within_half_a_step():
    exact, int8 = _compressed_pool(), _compressed_pool(value_dtype=torch.int8, landmark_dtype=torch.int8)
    values = torch.randn(6, 2, 4, 8) * torch.logspace(-3, 1, 6)[:, None, None, None]  # scales differ by chunk
    landmarks = values.mean(2)
    segs = [p.alloc_segment(0, 24, 1) for p in (exact, int8)]
    for p, seg in zip((exact, int8), segs):
        p.write_host_values(0, seg, values.transpose(1, 2).reshape(24, 2, 8))
        p.write_landmarks(0, seg, landmarks)
    exact_seg, seg = segs
    assert int8.host_v[0].dtype == int8.landmarks[0].dtype == torch.int8
    got = int8.read_host_values(0, seg, 1, 4)
    step = values[1:5].abs().amax((2, 3), keepdim=True) / 127
    assert ((got - values[1:5]).abs() <= step / 2 + 1e-7).all() and (got != values[1:5]).any()
    got_landmarks = int8.landmarks_of(0, seg.chunk_slots)
    step = landmarks.abs().amax(2, keepdim=True) / 127
    assert ((got_landmarks - landmarks).abs() <= step / 2 + 1e-7).all() and (got_landmarks != landmarks).any()
    torch.testing.assert_close(exact.landmarks_of(0, exact_seg.chunk_slots), landmarks)
    exact_bytes, int8_bytes = exact.segment_bytes(exact_seg), int8.segment_bytes(seg)
    assert int8_bytes["host_bytes"] * 4 == exact_bytes["host_bytes"]  # float32 pool: a quarter
    assert int8.layout.slots_per_page >= exact.layout.slots_per_page  # smaller state per chunk
    for name, args in (("value_dtype", (torch.float16, None)), ("landmark_dtype", (None, torch.float16))):
        with pytest.raises(ValueError, match=name):
            _compressed_pool(value_dtype=args[0], landmark_dtype=args[1])


def test_landmarks_and_outliers():
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(1, 1, 2, 16, generator=gen)
    k = (base + 0.01 * torch.randn(10, 4, 2, 16, generator=gen)).reshape(40, 2, 16)  # 10 chunks of 4
    k[4 * 6 + 1, 1] = -k[4 * 6 + 1, 1]  # chunk 6, head 1: one key points away from its chunk
    landmarks, min_cos = chunk_landmarks(k, 4)
    torch.testing.assert_close(landmarks, k.view(10, 4, 2, 16).mean(1))
    fit_error = torch.zeros(10, 2)
    fit_error[3] = 1.0  # chunk 3: the low-rank basis fits its keys worst, in both heads
    outliers = outlier_chunks(min_cos, fit_error, 4)
    assert (outliers[:, 0] == 0).all()  # the sink chunk, per head
    assert 6 in outliers[1, :2].tolist() and 6 not in outliers[0].tolist()  # by the landmark's fit
    assert (outliers[:, 2] == 3).all()  # then by the basis's fit
    assert all(len(set(row)) == 4 for row in outliers.tolist())


def test_config_sizes_and_errors():
    cfg = ShadowKVConfig(min_context=100, local_window=10, chunk_size=8, budget=0.1, min_budget_chunks=4,
                         span_grid=1)
    assert cfg.compressed_len(99, 8) == 0
    assert cfg.compressed_len(131, 8) == 120 and cfg.compressed_len(131, 16) == 112
    grid = ShadowKVConfig(min_context=100, local_window=10, span_grid=48)  # spans end on the grid, window kept
    assert grid.compressed_len(131, 8) == 96 and grid.compressed_len(105, 8) == 48 and grid.compressed_len(105, 32) == 0
    assert ShadowKVConfig().span_grid == 512
    assert cfg.budget_chunks(20) == 4 and cfg.budget_chunks(100) == 10 and cfg.budget_chunks(3) == 3
    assert ShadowKVConfig().copy_fraction == 0.25 and ShadowKVConfig(exact_copy_fraction=0.0).copy_fraction == 0
    assert ShadowKVConfig(host_mem_fraction=0.8).copy_fraction == pytest.approx(0.1)  # half of what values leave
    default = ShadowKVConfig()  # the energy rule's cap: the paper's 160, scaled up past 1024 key dims
    assert default.max_rank(1024) == 160 and default.max_rank(192) == 160 and default.max_rank(2048) == 320
    assert default.max_rank(96) == 96
    for kwargs, name in [({"budget": 0}, "shadowkv_budget"), ({"rank": -1}, "shadowkv_rank"),
                         ({"lowrank_method": "qr"}, "shadowkv_lowrank_method"),
                         ({"span_grid": 0}, "shadowkv_span_grid"),
                         ({"exact_copy_fraction": -0.1}, "shadowkv_exact_copy_fraction"),
                         ({"exact_copy_fraction": 0.6}, "shadowkv_host_mem_fraction \\+ shadowkv_exact_copy_fraction"),
                         ({"rank_energy": 1.5}, "shadowkv_rank_energy"),
                         ({"value_dtype": "fp4"}, "shadowkv_value_dtype"),
                         ({"landmark_dtype": "fp8"}, "shadowkv_landmark_dtype")]:
        with pytest.raises(ValueError, match=name):
            ShadowKVConfig(**kwargs)


# rank and budget chosen as by default (energy rule, top-p), the budget's cap lowered from 256 to 64
# chunks so that CPU decode steps stay affordable in CI
# (the compressed path is what these tests exercise: every long prompt is compressed at its prefill,
# the policy before compression became a tier of the cache; tests/test_tiering.py tests the tier)
SHADOW_ENGINE = dict(attention="shadowkv", max_total_tokens=16384, chunked_prefill_size=512,
                     shadowkv_min_context=512, shadowkv_host_tokens=4096, shadowkv_max_budget=64,
                     shadowkv_compress_policy="eager", check_integrity=True)


def grid_span(prompt_tokens: int) -> int:
    """Tokens of a prompt SHADOW_ENGINE compresses at its prefill: to the span grid's last line
    before the local window."""
    return ShadowKVConfig(min_context=512).compressed_len(prompt_tokens, 8)


@pytest.fixture(scope="module")
def shadow_engine():
    from sglang_shadowkv import Engine

    eng = Engine(**SHADOW_ENGINE)
    yield eng
    eng.shutdown()


def assert_shadow_pools_clean(eng) -> None:
    """With nothing running, every live segment is referenced by the radix tree alone (its refs
    are the tree's chunk entries), every chunk slot is free or in a live segment, and a flush
    frees them all."""
    from sglang_shadowkv.mem_cache.compressed_pool import ChunkRef

    sched = eng.scheduler
    store = sched.runner.compressed_pool
    tree_refs: dict[int, int] = {}
    for entry in sched.cache.tree.entries():
        if isinstance(entry, ChunkRef):
            tree_refs[id(entry.segment)] = tree_refs.get(id(entry.segment), 0) + 1
    assert {id(seg): seg.refs for seg in store.live.values()} == tree_refs
    assert store.free_chunks + sum(seg.num_chunks for seg in store.live.values()) == store.chunk_capacity
    sched.cache.check_integrity(sched.running)
    assert eng.flush_cache()
    pools = eng.get_server_info()["shadowkv"]["pools"]
    assert pools["free_chunk_slots"] == pools["chunk_slots"] and pools["segments"] == 0
    assert sched.runner.pool.num_free == sched.runner.pool.capacity - 1  # all but the null page


GREEDY = {"max_new_tokens": 16, "temperature": 0}


def test_compressed_decode_follows_full_attention(shadow_engine, engine):
    agree = total = 0
    for seed in range(2):
        ids = long_prompt(shadow_engine.tokenizer, 1200, seed)
        got = shadow_engine.generate(input_ids=ids, sampling_params=GREEDY)
        want = engine.generate(input_ids=ids, sampling_params=GREEDY)
        info = got["meta_info"]["shadowkv"]
        assert info["compressed_tokens"] == grid_span(1200) == 1024  # the window kept, on the span grid
        # at 1.2K tokens the fixed per-request scratch (budget + window) outweighs the saving, so
        # check the stored state: compressed + dense is smaller than a full cache, and adds up.
        assert info["gpu_compressed_bytes"] + info["dense_kv_bytes"] < info["full_kv_bytes"]
        assert info["gpu_total_bytes"] == (info["gpu_compressed_bytes"] + info["dense_kv_bytes"]
                                           + info["gpu_scratch_bytes"]) and info["host_bytes"] > 0
        assert 0 < info["chunk_cache_hit_rate"] < 1 and len(info["ranks"]) == 30
        assert all(1 <= r <= 160 for r in info["ranks"]) and len(set(info["ranks"])) > 1  # the energy rule
        budget = info["budget"]  # chunks per KV head and step, per layer (adaptive: they differ)
        steps = budget["head_steps"] / (30 * 3)  # every layer and KV head of each decode step
        assert len(budget["mean_chunks_per_layer"]) == 30 and steps in (len(got["output_ids"]) - 1, len(got["output_ids"]))
        assert all(0 < m <= p99 <= budget["max_chunks"]
                   for m, p99 in zip(budget["mean_chunks_per_layer"], budget["p99_chunks_per_layer"]))
        assert len(set(budget["mean_chunks_per_layer"])) > 1  # adaptive: layers take different counts
        assert want["meta_info"]["shadowkv"] == {"compressed_tokens": 0}
        agree += sum(a == b for a, b in zip(got["output_ids"], want["output_ids"]))
        total += len(want["output_ids"])
    assert agree / total >= 0.8
    server = shadow_engine.get_server_info()["shadowkv"]
    assert server["ranks"]["last_per_layer"] == info["ranks"] and len(server["ranks"]["mean_per_layer"]) == 30
    assert server["budget"]["head_steps"] >= budget["head_steps"] and server["config"]["budget"] == "auto"
    assert_pool_clean(shadow_engine)
    assert_shadow_pools_clean(shadow_engine)


def test_the_step_log_shows_a_compression_and_the_gpu_values(shadow_engine, tmp_path, monkeypatch):
    import json

    from sglang_shadowkv.scheduler.counters import StepLog

    sched = shadow_engine.scheduler
    monkeypatch.setattr(sched.step_times, "log", StepLog(str(tmp_path / "steps.jsonl")))
    doc, questions = document_and_questions(shadow_engine.tokenizer, 900, 31)
    loaded = sched.stats["dense_copy_prefills"]
    for question in questions[:2]:  # the first compresses the document; the second asks over it
        shadow_engine.generate(input_ids=doc + question, sampling_params={"max_new_tokens": 3, "temperature": 0})
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert sum("+compress" in s["label"] for s in steps) == 1
    assert sched.stats["dense_copy_prefills"] == loaded + 1  # the second question: over the copy, loaded dense
    loads = [s["gpu_values"] for s in steps]
    assert loads == sorted(loads) and all(s["pages"]["unused"] >= 0 for s in steps)
    assert loads[-1][0] == loads[0][0] + 1  # the document's values went onto the device (the pool is nearly empty)
    sparse = [s["sparse_rows"] for s in steps if s["decode_rows"]]
    assert [1, 1] in sparse and all(0 <= held <= rows <= 1 for rows, held in sparse)  # the second question's decode


def test_int8_values_and_landmarks_decode_like_exact_ones(shadow_engine):
    from sglang_shadowkv import Engine

    eng = Engine(**SHADOW_ENGINE, shadowkv_value_dtype="int8", shadowkv_landmark_dtype="int8")
    try:
        ids = long_prompt(shadow_engine.tokenizer, 1200, 3)
        got = eng.generate(input_ids=ids, sampling_params=GREEDY)
        want = shadow_engine.generate(input_ids=ids, sampling_params=GREEDY)
        assert sum(a == b for a, b in zip(got["output_ids"], want["output_ids"])) >= 0.8 * len(want["output_ids"])
        got_info, want_info = got["meta_info"]["shadowkv"], want["meta_info"]["shadowkv"]
        assert got_info["host_bytes"] * 4 == want_info["host_bytes"]  # float32 on the CPU
        # int8 landmarks: as many or more chunk slots per page (on this model's float32 pages, as many)
        assert got_info["gpu_compressed_bytes"] <= want_info["gpu_compressed_bytes"]
        assert got_info["compressed_tokens"] == want_info["compressed_tokens"] > 0
    finally:
        eng.shutdown()


def test_mixed_batch_of_compressed_and_dense_requests(shadow_engine):
    tok = shadow_engine.tokenizer
    prompts = [long_prompt(tok, 900, 5), tok.encode("The capital of France is"), long_prompt(tok, 700, 6)]
    alone = [shadow_engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    shadow_engine.flush_cache()
    batched = shadow_engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in batched] == alone
    assert [o["meta_info"]["shadowkv"]["compressed_tokens"] > 0 for o in batched] == [True, False, True]
    info = shadow_engine.get_server_info()["shadowkv"]
    assert info["compressed_requests"] >= 4 and info["running_compressed_requests"] == 0
    assert_pool_clean(shadow_engine)
    assert_shadow_pools_clean(shadow_engine)


def test_abort_frees_the_segment(shadow_engine):
    from sglang_shadowkv.sampling_params import SamplingParams

    sched = shadow_engine.scheduler
    req = sched.add_request("to-abort", long_prompt(shadow_engine.tokenizer, 800, 9),
                            SamplingParams.from_dict({"max_new_tokens": 50}))
    while not (req.shadowkv is not None and req.shadowkv.layout is not None):
        sched.step()
    sched.step()
    stats = shadow_engine.get_server_info()["shadowkv"]
    assert stats["running_compressed_requests"] == 1
    report = stats["per_request"]["to-abort"]  # a chunk's state takes less than its dense KV (outliers and
    # basis are per segment: on this small model a short document's total is not smaller)
    kv_bytes = shadow_engine.get_server_info()["memory"]["kv_bytes_per_token"]
    assert report["gpu_slot_page_bytes"] < report["compressed_tokens"] * kv_bytes
    assert sched.abort("to-abort")
    assert_pool_clean(shadow_engine)
    assert_shadow_pools_clean(shadow_engine)


def test_prompt_beyond_the_compressed_pools_is_rejected(shadow_engine):
    ids = long_prompt(shadow_engine.tokenizer, 5000, 3)
    with pytest.raises(ValueError, match="shadowkv_host_tokens"):
        shadow_engine.generate(input_ids=ids, sampling_params=GREEDY)
    assert_pool_clean(shadow_engine)


def document_and_questions(tokenizer, num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    order = torch.randint(0, len(SENTENCES), (num_tokens // 8,), generator=gen).tolist()
    doc = tokenizer.encode(" ".join(SENTENCES[i] for i in order), add_special_tokens=False)[:num_tokens]
    questions = ["what did the merchants bring?", "what did the children learn from?",
                 "what did the farmers dig?", "where were the records kept?", "what did the town smell of?"]
    return doc, [tokenizer.encode(f"\nQuestion: {q} Answer:", add_special_tokens=False) for q in questions]


def greedy_answers(sched, doc: list[int], questions: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Compress the document (its own request), then answer each question over it, one at a time."""
    from sglang_shadowkv.sampling_params import SamplingParams

    def run(rid, ids):
        req = sched.add_request(rid, ids, SamplingParams(max_new_tokens=new_tokens, temperature=0))
        while sched.has_work:
            sched.step()
        return req

    run("doc", doc + questions[0])
    answers = []
    for i, q in enumerate(questions):
        req = run(f"q{i}", doc + q)
        assert req.cached_tokens >= len(doc) - 8 and req.shadowkv.layout is not None
        answers.append(req.output_ids)
    return answers


def counters(eng) -> dict:
    return dict(eng.get_server_info()["stats"])


def test_a_compressed_document_is_shared_by_later_requests(shadow_engine):
    shadow_engine.flush_cache()
    doc, questions = document_and_questions(shadow_engine.tokenizer, 1200, 21)
    sampling = {"max_new_tokens": 24, "temperature": 0}
    shadow_engine.generate(input_ids=doc + questions[0], sampling_params=sampling)
    before = counters(shadow_engine)
    shared = shadow_engine.generate(input_ids=doc + questions[1], sampling_params=sampling)
    after = counters(shadow_engine)
    assert shared["meta_info"]["cached_tokens"] == 1200  # the document: compressed chunks + dense tail
    assert shared["meta_info"]["shadowkv"]["compressed_tokens"] == grid_span(1200 + len(questions[0]))
    assert after["compressions"] == before["compressions"]  # nothing compressed again
    assert after["compressed_prefix_hits"] == before["compressed_prefix_hits"] + 1
    assert after["prefill_tokens"] - before["prefill_tokens"] == len(questions[1])
    assert_pool_clean(shadow_engine)
    assert_shadow_pools_clean(shadow_engine)  # flushes
    alone = shadow_engine.generate(input_ids=doc + questions[1], sampling_params=sampling)
    # the span grid: both compressed the document's first 1024 tokens, so one form (the ranks the
    # energy rule read from the same keys), though each compressed its own question's prompt
    assert alone["meta_info"]["shadowkv"]["compressed_tokens"] == 1024
    assert shared["meta_info"]["shadowkv"]["ranks"] == alone["meta_info"]["shadowkv"]["ranks"]
    agree = sum(a == b for a, b in zip(shared["output_ids"], alone["output_ids"])) / 24
    assert agree >= 0.95, (shared["text"], alone["text"])


def test_a_prompt_sharing_only_a_short_start_of_a_compressed_document_runs_cold(shadow_engine):
    """Sharing fewer than min_context (512) tokens of a compressed document is no hit: the prompt
    runs as it would cold, token for token; sharing more is one."""
    shadow_engine.flush_cache()
    doc, questions = document_and_questions(shadow_engine.tokenizer, 1200, 21)
    other, _ = document_and_questions(shadow_engine.tokenizer, 800, 5)
    sampling = {"max_new_tokens": 16, "temperature": 0}
    shadow_engine.generate(input_ids=doc + questions[0], sampling_params=sampling)
    before = counters(shadow_engine)
    short = shadow_engine.generate(input_ids=doc[:200] + other + questions[1], sampling_params=sampling)
    after = counters(shadow_engine)
    assert after["compressed_prefix_hits"] == before["compressed_prefix_hits"]
    assert short["meta_info"]["cached_tokens"] == 0
    long = shadow_engine.generate(input_ids=doc[:600] + other + questions[1], sampling_params=sampling)
    assert counters(shadow_engine)["compressed_prefix_hits"] == after["compressed_prefix_hits"] + 1
    assert long["meta_info"]["cached_tokens"] >= 592
    assert_shadow_pools_clean(shadow_engine)  # flushes
    cold = shadow_engine.generate(input_ids=doc[:200] + other + questions[1], sampling_params=sampling)
    assert short["output_ids"] == cold["output_ids"]


def test_multi_turn_chat_compresses_the_document_once(shadow_engine):
    shadow_engine.flush_cache()
    doc, questions = document_and_questions(shadow_engine.tokenizer, 1200, 22)
    before = counters(shadow_engine)
    history, cached = list(doc), []
    for question in questions:  # 5 turns, each prompt = the previous turns + a new question
        prompt = history + question
        out = shadow_engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 12, "temperature": 0})
        cached.append(out["meta_info"]["cached_tokens"])
        history = prompt + out["output_ids"]
    after = counters(shadow_engine)
    assert after["compressions"] - before["compressions"] == 1
    assert after["compressed_prefix_hits"] - before["compressed_prefix_hits"] == 4
    assert cached[0] == 0 and all(c >= 1200 for c in cached[1:])
    assert after["prefill_tokens"] - before["prefill_tokens"] < 1200 + 5 * 40  # the document once
    assert_pool_clean(shadow_engine)
    assert_shadow_pools_clean(shadow_engine)


def test_requests_arriving_together_compress_a_shared_document_once(shadow_engine):
    shadow_engine.flush_cache()
    doc, questions = document_and_questions(shadow_engine.tokenizer, 1200, 27)
    before = counters(shadow_engine)
    outs = shadow_engine.generate(input_ids=[doc + q for q in questions[:4]],
                                  sampling_params={"max_new_tokens": 4, "temperature": 0})
    after = counters(shadow_engine)
    assert after["compressions"] - before["compressions"] == 1
    assert after["compressed_prefix_hits"] - before["compressed_prefix_hits"] == 3
    compressed_end = grid_span(1200 + len(questions[0]))  # the first request's compressed chunks
    assert all(o["meta_info"]["cached_tokens"] == compressed_end for o in outs[1:])
    # the document once, but for its dense end past the span, prefilled by each later one
    assert after["prefill_tokens"] - before["prefill_tokens"] < 1200 + 3 * (1200 - compressed_end) + 4 * 100
    assert_pool_clean(shadow_engine)
    assert_shadow_pools_clean(shadow_engine)


def test_a_long_dense_tail_becomes_a_second_segment(shadow_engine):
    shadow_engine.flush_cache()
    doc, questions = document_and_questions(shadow_engine.tokenizer, 1200, 23)
    long_message = long_prompt(shadow_engine.tokenizer, 476, 24)  # below the 512-token threshold
    first = doc + questions[0]
    out = shadow_engine.generate(input_ids=first, sampling_params={"max_new_tokens": 4, "temperature": 0})
    second = first + out["output_ids"] + long_message
    before = counters(shadow_engine)
    # the answer takes its dense tail (the message and what it generates) past 512 tokens and a grid
    # step past the local window
    out = shadow_engine.generate(input_ids=second, sampling_params={"max_new_tokens": 112, "temperature": 0,
                                                                    "ignore_eos": True})
    assert out["meta_info"]["shadowkv"]["segments"] == 1  # the document; its own part stayed dense
    assert counters(shadow_engine)["tail_compressions"] == before["tail_compressions"] + 1
    third = second + out["output_ids"] + questions[1]
    out = shadow_engine.generate(input_ids=third, sampling_params={"max_new_tokens": 8, "temperature": 0})
    info = out["meta_info"]["shadowkv"]
    assert info["segments"] == 2 and info["compressed_tokens"] == grid_span(len(first)) + 512
    assert_pool_clean(shadow_engine)
    assert_shadow_pools_clean(shadow_engine)


@pytest.mark.parametrize("method", ["subspace", "eigh"])
def test_a_segment_compressed_in_one_batch_equals_its_layers_compressed_alone(method):
    """SegmentCompression solves every layer's basis together: each layer must get the rank, basis
    and low-rank keys it gets compressed on its own (layers of different spectra: no mixing)."""
    from sglang_shadowkv.layers.rotary import RotaryEmbedding
    from sglang_shadowkv.mem_cache.compressed_pool import ShadowKVPool
    from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool
    from sglang_shadowkv.shadowkv.compress import SegmentCompression, compress_layer

    layers, heads, head_dim, tokens = 3, 2, 32, 64
    cfg = ShadowKVConfig(rank_cap=24, lowrank_method=method, outliers=2)
    rotary = RotaryEmbedding(head_dim, 10000.0, 256)
    gen = torch.Generator().manual_seed(7)
    keys, values = [], []
    for layer, true_rank in enumerate((3, 9, 40)):  # the last one past the cap
        k = torch.randn(tokens, true_rank, generator=gen) @ torch.randn(true_rank, heads * head_dim, generator=gen)
        k_pre = (k + 1e-3 * torch.randn(k.shape, generator=gen)).view(tokens, heads, head_dim)
        keys.append(rotary.apply(k_pre, torch.arange(tokens)))  # the pool holds post-RoPE keys
        values.append(torch.randn(tokens, heads, head_dim, generator=gen))

    def pool():
        return ShadowKVPool(PagedKVPool(64, 4, layers, heads, head_dim, torch.float32, "cpu"), 24, 32, 2)

    together, alone = pool(), pool()
    seg_together, seg_alone = together.alloc_segment(0, tokens, 2), alone.alloc_segment(0, tokens, 2)
    job = SegmentCompression(together, seg_together, rotary, cfg)
    for layer in range(layers):
        job.add_layer(layer, keys[layer], values[layer])
        compress_layer(alone, seg_alone, layer, keys[layer], values[layer], rotary, cfg)
    job.finish(lambda layer: (keys[layer], values[layer]))
    ranks = seg_together.settle_ranks()
    assert ranks == seg_alone.settle_ranks()
    assert ranks[0] == 3 and ranks[1] == 9 and ranks[2] == 24
    for layer in range(layers):
        torch.testing.assert_close(together.lowrank_rows(layer, seg_together.chunk_slots),
                                   alone.lowrank_rows(layer, seg_alone.chunk_slots), atol=1e-4, rtol=1e-4)
