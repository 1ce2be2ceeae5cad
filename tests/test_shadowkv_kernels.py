"""ShadowKV kernels against their torch references on fresh random inputs (interpreter on CPU); head
dims of 48 stand for those that are no power of two (Phi-3: 96)."""

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_shadowkv.kernels.chunk_stats import chunk_stats, chunk_stats_reference
from sglang_shadowkv.kernels.gather_values import gather_values, gather_values_reference
from sglang_shadowkv.kernels.landmark_scores import (landmark_logits, landmark_logits_reference, tile_landmark_mass,
                                                      tile_landmark_mass_reference)
from sglang_shadowkv.kernels import rebuild_keys as rk
from sglang_shadowkv.kernels.rebuild_keys import rebuild_keys, rebuild_keys_reference
from sglang_shadowkv.kernels.rotary import rotate, rotate_reference
from sglang_shadowkv.kernels.sparse_decode_attention import sparse_decode_attention, sparse_decode_attention_reference
from sglang_shadowkv.layers.rotary import RotaryEmbedding
from sglang_shadowkv.mem_cache.compressed_pool import ShadowKVPool
from sglang_shadowkv.mem_cache.host_memory import PinnedHostTensor
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool
from sglang_shadowkv.shadowkv.chunk_cache import plan_chunk_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4 if DEVICE == "cpu" else 3e-3  # GPU float32 dots may run as TF32


def _jobs(gen, batch, heads, entries, num_slots, hit_fraction=0.3):
    """Random chunk slots per (request, head, entry), some -1 (cache hits), distinct per row."""
    jobs = torch.stack([torch.randperm(num_slots - 1, generator=gen)[:entries] + 1
                        for _ in range(batch * heads)]).view(batch, heads, entries)
    return torch.where(torch.rand(jobs.shape, generator=gen) < hit_fraction, -1, jobs)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("group", [1, 2, 3, 8])
@pytest.mark.parametrize("head_dim,num_chunks", [(32, 37), (64, 70), (48, 5)])
def test_landmark_logits(group, head_dim, num_chunks, int8):
    gen = torch.Generator().manual_seed(group * 1000 + num_chunks + int8)
    batch, hkv, slots = 3, 2, 200
    q = torch.randn(batch, hkv * group, head_dim, generator=gen)
    landmarks = torch.randn(slots, hkv, head_dim, generator=gen)
    scale = None
    if int8:  # the int8 landmark pool: one scale per chunk slot and KV head
        landmarks = torch.randint(-127, 128, landmarks.shape, generator=gen, dtype=torch.int8)
        scale = (torch.rand(slots, hkv, generator=gen) + 0.01).to(DEVICE) / 127
    selectable = (torch.rand(slots, hkv, generator=gen) < 0.8).to(torch.int8)
    selectable[0] = 0
    chunk_slots = torch.stack([torch.randperm(slots - 1, generator=gen)[:num_chunks] + 1 for _ in range(batch)])
    chunk_slots[1, num_chunks // 2:] = 0  # a shorter request, padded with slot 0
    args = [t.to(DEVICE) for t in (q, landmarks, chunk_slots.int(), selectable)] + [head_dim ** -0.5]
    got, want = landmark_logits(*args, scale), landmark_logits_reference(*args, scale)
    assert torch.equal(got.isinf(), want.isinf())
    assert want.isinf().any() and not want.isinf().all()
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    if head_dim == 32:  # a CUDA graph's padding rows (from live on) are skipped, the rest as before
        live = torch.tensor([2], dtype=torch.int32, device=DEVICE)
        torch.testing.assert_close(landmark_logits(*args, scale, live)[:2], want[:2], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("queries", [3, 20])  # a tile shorter than a query block, and over one
@pytest.mark.parametrize("num_chunks,int8,head_dim", [(37, False, 32), (150, True, 48)])
def test_tile_landmark_mass(group, queries, num_chunks, int8, head_dim):
    gen = torch.Generator().manual_seed(group * 100 + queries + num_chunks)
    tiles, hkv, slots = 3, 2, 200
    q = torch.randn(tiles, queries, hkv * group, head_dim, generator=gen)
    q_valid = torch.ones(tiles, queries, dtype=torch.bool)
    q_valid[1, queries // 2:] = False  # a padded tile
    landmarks = torch.randn(slots, hkv, head_dim, generator=gen)
    scale = None
    if int8:
        landmarks = torch.randint(-127, 128, landmarks.shape, generator=gen, dtype=torch.int8)
        scale = (torch.rand(slots, hkv, generator=gen) + 0.01).to(DEVICE) / 127
    selectable = (torch.rand(slots, hkv, generator=gen) < 0.8).to(torch.int8)
    selectable[0] = 0
    chunk_slots = torch.stack([torch.randperm(slots - 1, generator=gen)[:num_chunks] + 1 for _ in range(tiles)])
    chunk_slots[2, num_chunks // 3:] = 0  # a shorter request, padded with the null slot
    args = [t.to(DEVICE) for t in (q, q_valid, landmarks, chunk_slots.int(), selectable)] + [head_dim ** -0.5]
    got = tile_landmark_mass(*args, scale, block_n=32)
    want = tile_landmark_mass_reference(*args, scale)
    assert torch.equal(got < 0, want < 0) and (want == -1).any() and (want >= 0).any()
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    # each query head's probabilities sum to 1, so a KV head's mass is at least its valid queries'
    # count (the max over the group) and at most that times the group
    mass, count = want.clamp(min=0).sum(-1), q_valid.sum(1).to(DEVICE)[:, None].float()
    assert (mass >= count - 1e-4).all() and (mass <= count * group + 1e-4).all()


def _scratch_table(gen, pages: torch.Tensor, rows: int, entries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A scratch page table [rows, entries] (int32) of distinct pages drawn at random from `pages`
    (so rows are not contiguous and have pages no row names between them), and the pages left."""
    order = pages[torch.randperm(pages.numel(), generator=gen)]
    return order[:rows * entries].view(rows, entries).int(), order[rows * entries:]


def _page_blocks(pages: torch.Tensor, hkv: int) -> torch.Tensor:
    """Every [c, D] block of the given pages (block page·Hkv + h)."""
    return (pages.long()[:, None] * hkv + torch.arange(hkv)).flatten()


def assert_writes_only_jobs(got: torch.Tensor, before: torch.Tensor, poisoned_pages: torch.Tensor,
                            table: torch.Tensor, rows: torch.Tensor, jobs: torch.Tensor) -> None:
    """Of the NaN-poisoned pages' blocks exactly the jobs' entries were written (not the hits, not
    the pages no row names), and every other block is bit for bit as before."""
    hkv = jobs.shape[1]
    targets = {int(table[int(rows[b]), e]) * hkv + h for b, h, e in (jobs >= 0).nonzero().tolist()}
    poisoned = _page_blocks(poisoned_pages, hkv).to(got.device)
    written = poisoned[~got[poisoned].isnan().flatten(1).all(1)]
    assert set(written.tolist()) == targets and targets
    others = torch.ones(len(got), dtype=torch.bool, device=got.device)
    others[poisoned] = False
    assert torch.equal(got[others].view(torch.int32), before[others].view(torch.int32))


def _pool_with_segments(gen, chunk_size, hkv, head_dim, rank, chunks=(5, 9, 3)):
    """A compressed pool inside a dense pool (one layer) holding segments with random low-rank rows
    and bases written through the pool (every column, past any rank too)."""
    kv = PagedKVPool(64, chunk_size, 1, hkv, head_dim, torch.float32, DEVICE)
    store = ShadowKVPool(kv, rank, host_chunks=100, max_segments=8)
    segs, start = [], 0
    for n in chunks:
        seg = store.alloc_segment(start, n * chunk_size, 1)
        store.chunk_pos[seg.chunk_slots] = torch.randint(0, 2048 - chunk_size, (n,), generator=gen).int().to(DEVICE)
        store.write_lowrank(0, seg, torch.randn(n * chunk_size, rank, generator=gen).to(DEVICE))
        store.write_basis(0, seg, (torch.randn(rank, hkv * head_dim, generator=gen) / rank ** 0.5).to(DEVICE))
        segs.append(seg)
        start += n * chunk_size
    return store, segs


@pytest.mark.parametrize("ranked", [False, True])
@pytest.mark.parametrize("chunk_size,rank,hkv,head_dim,rotary_dim", [(8, 30, 3, 32, 32), (8, 64, 2, 32, 16),
                                                                     (4, 17, 3, 48, 48), (16, 40, 2, 64, 64)])
def test_rebuild_keys(chunk_size, rank, hkv, head_dim, rotary_dim, ranked, monkeypatch):
    """Kernel against reference on the pool's own layout (low-rank rows split between a slot's K
    and V shares, bases in pages), also with two entries a program (the misses of a head spread
    over several programs), and the reference against RoPE of rows times basis; with partial
    rotary the unrotated dims of a rebuilt key are those of rows times basis."""
    gen = torch.Generator().manual_seed(chunk_size * 100 + rank)
    store, segs = _pool_with_segments(gen, chunk_size, hkv, head_dim, rank)
    rotary = RotaryEmbedding(head_dim, 10000.0, 2048, rotary_dim=rotary_dim).to(DEVICE)
    slots = torch.cat([seg.chunk_slots for seg in segs]).cpu()
    batch, entries = 3, 6
    picks = torch.stack([slots[torch.randperm(len(slots), generator=gen)[:entries]] for _ in range(batch * hkv)])
    jobs = torch.where(torch.rand(picks.shape, generator=gen) < 0.3, -1, picks).view(batch, hkv, entries).to(DEVICE)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32, device=DEVICE)
    # scratch rows: random free pages of the pool, poisoned like every page they might land between
    free = torch.tensor(store.kv.alloc(store.kv.num_free))
    table, _ = _scratch_table(gen, free, 5, entries)
    blocks = store.blocks_k[0].clone()
    blocks[_page_blocks(free, hkv).to(DEVICE)] = float("nan")
    pages = table.to(DEVICE)
    # each segment its own rank (past it the pool holds values that must not be read), one over the width
    ranks = [rank, 1, rank + 5]
    basis_rank = None
    if ranked:
        basis_rank = torch.zeros(8, dtype=torch.int32, device=DEVICE)
        basis_rank[[seg.seg_id for seg in segs]] = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    args = (store.a_lo[0], store.a_hi[0], *store.basis_memory(0), rotary.cos_cache, rotary.sin_cache,
            store.chunk_pos, store.chunk_basis, jobs)
    got = rebuild_keys(*args, blocks.clone(), pages, rows, basis_rank)
    want = rebuild_keys_reference(*args, blocks.clone(), pages, rows, basis_rank)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, equal_nan=True)
    assert_writes_only_jobs(want, blocks, free, table, rows, jobs)
    monkeypatch.setattr(rk, "ROWS_PER_PROGRAM", 16)  # (Triton 3.6 fails to compile 32-row tiles for sm_90)
    torch.testing.assert_close(rebuild_keys(*args, blocks.clone(), pages, rows, basis_rank), want, rtol=TOL,
                               atol=TOL, equal_nan=True)
    monkeypatch.undo()
    if ranked:  # a CUDA graph's padding rows (from live on): none of their jobs are done
        live = torch.tensor([2], dtype=torch.int32, device=DEVICE)
        got = rebuild_keys(*args, blocks.clone(), pages, rows, basis_rank, live)
        want = rebuild_keys_reference(*args, blocks.clone(), pages, rows, basis_rank, live)
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, equal_nan=True)
        assert_writes_only_jobs(want, blocks, free, table, rows, torch.cat([jobs[:2], torch.full_like(jobs[2:], -1)]))
    k_pages, v_pages, basis_pages = store.basis_memory(0)
    for b, h, e in (jobs >= 0).nonzero().tolist()[:6]:  # the reference itself, chunk by chunk
        slot = int(jobs[b, h, e])
        seg = next(s for s in segs if slot in s.chunk_slots.tolist())
        r = min(ranks[segs.index(seg)], rank) if ranked else rank
        low = torch.cat([store.a_lo[0][slot], store.a_hi[0][slot]], 1)[:, :r]
        basis = torch.stack([k_pages[basis_pages[seg.seg_id].long()], v_pages[basis_pages[seg.seg_id].long()]],
                            1).flatten(0, 2)[:r]
        pre = (low @ basis).view(chunk_size, hkv, head_dim)
        pos = torch.arange(int(store.chunk_pos[slot]), int(store.chunk_pos[slot]) + chunk_size, device=DEVICE)
        block = int(table[int(rows[b]), e]) * hkv + h
        torch.testing.assert_close(want[block], rotary.apply(pre, pos)[:, h], rtol=1e-4, atol=1e-4)
        unrotated = _unrotated_dims(head_dim, rotary_dim)
        torch.testing.assert_close(want[block][:, unrotated], pre[:, h, unrotated], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("chunk_size,head_dim,jobs_per_step", [(8, 64, 1), (8, 128, 4), (4, 32, 8)])
def test_gather_values(chunk_size, head_dim, jobs_per_step, int8):
    gen = torch.Generator().manual_seed(chunk_size + head_dim + int8)
    batch, hkv, entries, slots = 4, 2, 7, 50
    host = torch.randn(slots, hkv, chunk_size, head_dim, generator=gen)
    scale = None
    if int8:  # the int8 host pool: one scale per chunk slot and KV head, on the GPU
        host = torch.randint(-127, 128, host.shape, generator=gen, dtype=torch.int8)
        scale = (torch.rand(slots, hkv, generator=gen) + 0.01).to(DEVICE)
    if DEVICE == "cuda":  # the engine's host pool: an exact-size registered allocation, read via UVA
        owner = PinnedHostTensor(tuple(host.shape), host.dtype)
        host = owner.tensor.copy_(host)
        assert host.is_pinned() and host.data_ptr() == owner.tensor.data_ptr()
    jobs = _jobs(gen, batch, hkv, entries, slots).to(DEVICE)
    rows = torch.tensor([1, 5, 0, 3], dtype=torch.int32, device=DEVICE)
    # the pool's V memory as blocks: scratch rows on random pages, NaN in every page they may use
    num_pages = 100
    scratch_pages, spare = _scratch_table(gen, torch.arange(1, num_pages), 6, entries)
    blocks = torch.randn(num_pages * hkv, chunk_size, head_dim, generator=gen)
    poisoned = torch.cat([scratch_pages.flatten(), spare])
    blocks[_page_blocks(poisoned, hkv)] = float("nan")
    host_slot = torch.randperm(slots, generator=gen).int().to(DEVICE)  # chunk slot -> host slot
    blocks, pages = blocks.to(DEVICE), scratch_pages.to(DEVICE)
    got = gather_values(host, host_slot, jobs, blocks.clone(), pages, rows, scale, programs=3,
                        jobs_per_step=jobs_per_step)
    want = gather_values_reference(host, host_slot, jobs, blocks.clone(), pages, rows, scale)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert_writes_only_jobs(want, blocks, poisoned, scratch_pages, rows, jobs)
    live = torch.tensor([3], dtype=torch.int32, device=DEVICE)  # the last row is a CUDA graph's padding
    got = gather_values(host, host_slot, jobs, blocks.clone(), pages, rows, scale, live=live, programs=3,
                        jobs_per_step=jobs_per_step)
    want = gather_values_reference(host, host_slot, jobs, blocks.clone(), pages, rows, scale, live=live)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    live_jobs = torch.cat([jobs[:3], torch.full_like(jobs[3:], -1)])
    assert_writes_only_jobs(want, blocks, poisoned, scratch_pages, rows, live_jobs)


@pytest.mark.parametrize("int8", [False, True])
def test_gather_values_reads_resident_chunks_from_the_gpu_copy(int8):
    """Chunks with a home in the pool's pages are read there (K or V memory by the home's low
    bit), the others from the host pool; the copies hold different data here, so a chunk read
    from the wrong place shows."""
    gen = torch.Generator().manual_seed(7 + int8)
    batch, hkv, entries, slots, c, d, res_blocks = 3, 2, 6, 40, 8, 32, 30

    def chunks(n):
        x = torch.randn(n, hkv, c, d, generator=gen)
        return torch.randint(-127, 128, x.shape, generator=gen, dtype=torch.int8) if int8 else x

    host, res_k, res_v = chunks(slots), chunks(res_blocks).to(DEVICE), chunks(res_blocks).to(DEVICE)
    scale = (torch.rand(slots, hkv, generator=gen) + 0.01).to(DEVICE) if int8 else None
    home = torch.full((slots,), -1, dtype=torch.int32)
    resident = torch.randperm(slots, generator=gen)[:slots // 2]
    home[resident] = torch.randperm(2 * res_blocks, generator=gen)[:len(resident)].int()
    jobs = _jobs(gen, batch, hkv, entries, slots).to(DEVICE)
    rows = torch.tensor([2, 0, 1], dtype=torch.int32, device=DEVICE)
    pages = torch.arange(1, 1 + 3 * entries, dtype=torch.int32).view(3, entries).to(DEVICE)
    blocks = torch.zeros(64 * hkv, c, d, device=DEVICE)
    host_slot = torch.randperm(slots, generator=gen).int().to(DEVICE)
    args = (host.to(DEVICE), host_slot, jobs)
    res = (home.to(DEVICE), res_k, res_v)
    got = gather_values(*args, blocks.clone(), pages, rows, scale, resident=res,
                        jobs_per_step=16)  # 36 jobs: the last step is partly past the end
    want = gather_values_reference(*args, blocks.clone(), pages, rows, scale, resident=res)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for b, h, e in (jobs >= 0).nonzero().tolist():  # each job's source, spelled out
        slot, at = int(jobs[b, h, e]), int(home[int(jobs[b, h, e])])
        src = host[int(host_slot[slot])] if at < 0 else (res_k, res_v)[at % 2][at // 2]
        expect = src[h].float().to(DEVICE) * (1 if scale is None else scale[slot, h])
        block = int(pages[int(rows[b]), e]) * hkv + h
        torch.testing.assert_close(want[block], expect.to(want.dtype), rtol=0, atol=0)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("chunk_size,head_dim", [(8, 64), (4, 48)])
@pytest.mark.parametrize("queries", [1, 5, 20])  # per request: a decode query, or a suffix tile's
@pytest.mark.parametrize("splits", [1, 3, 16])  # each program's keys split among 3 (16: the most) programs, merged
def test_sparse_decode_attention(group, chunk_size, head_dim, queries, splits):
    gen = torch.Generator().manual_seed(group * 10 + head_dim + queries)
    batch, hkv, entries, pool_slots, num_pages = 3, 2, 9, 300, 80
    q = torch.randn(batch * queries, hkv * group, head_dim, generator=gen)
    # one block array for outliers and scratch: outliers on 15 random pages, scratch rows on others
    order = torch.randperm(num_pages - 1, generator=gen) + 1
    outlier_pages = order[:15]
    scratch_pages, spare = _scratch_table(gen, order[15:], 4, entries)
    blocks_k, blocks_v = (torch.randn(num_pages * hkv, chunk_size, head_dim, generator=gen) for _ in range(2))
    outliers = (outlier_pages[torch.randint(0, 15, (batch, hkv, 5), generator=gen)] * hkv
                + torch.arange(hkv)[:, None]).int()
    outliers[0, :, 3:] = -1  # fewer outliers for request 0
    ent = torch.stack([torch.randperm(entries, generator=gen) for _ in range(batch * hkv)]).view(batch, hkv, entries)
    ent[1, :, 6:] = -1  # request 1 selected fewer chunks than the budget
    rows = torch.tensor([2, 0, 3], dtype=torch.int32)
    unread = [_page_blocks(spare, hkv), _page_blocks(scratch_pages[1], hkv)]  # pages no request's row names
    for h in range(hkv):  # the entries request 1 does not hold were never written: garbage, never read
        unheld = torch.ones(entries, dtype=torch.bool)
        unheld[ent[1, h, :6]] = False
        unread.append(scratch_pages[0, unheld].long() * hkv + h)
    for blocks in (blocks_k, blocks_v):
        blocks[torch.cat(unread)] = float("nan")
    k_pool, v_pool = (torch.randn(pool_slots, hkv, head_dim, generator=gen) for _ in range(2))
    lens = [3, 70, 0]  # dense windows, one longer than a block, one empty
    window = torch.randperm(pool_slots, generator=gen)[:sum(lens)].int()
    indptr = torch.tensor([0] + lens).cumsum(0).int()
    args = [t.to(DEVICE) for t in (q, blocks_k, blocks_v, outliers, scratch_pages, rows, ent.int(),
                                   k_pool, v_pool, indptr, window)] + [head_dim ** -0.5]
    lse_got, lse_want = (torch.full((batch * queries, hkv * group), float("nan"), device=DEVICE) for _ in range(2))
    want = sparse_decode_attention_reference(*args, lse=lse_want, queries_per_request=queries)
    got = sparse_decode_attention(*args, lse=lse_got, queries_per_request=queries, splits=splits)
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    torch.testing.assert_close(lse_got, lse_want, rtol=TOL, atol=TOL)
    assert lse_want.isfinite().all()
    if splits == 3:  # the outliers read from memory of their own (an exact suffix round's pool, beside its workspace)
        other = [torch.full_like(args[1], float("nan")) for _ in range(2)]
        ids = outliers[outliers >= 0].long().to(DEVICE)
        for mem, src in zip(other, args[1:3]):
            mem[ids] = src[ids]
        moved = [args[0], *[src.clone() for src in args[1:3]], *args[3:]]
        for mem in moved[1:3]:
            mem[ids] = float("nan")  # (no scratch entry shares an outlier's page)
        for fn, extra in ((sparse_decode_attention_reference, {}), (sparse_decode_attention, {"splits": splits})):
            got = fn(*moved, queries_per_request=queries, outlier_memory=tuple(other), **extra)
            torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    if group == 4:  # requests from live on (a CUDA graph's padding) attend nothing: zeros, lse -inf
        live = torch.tensor([1], dtype=torch.int32, device=DEVICE)
        gated = sparse_decode_attention_reference(*args, lse=lse_want, queries_per_request=queries, live=live)
        assert torch.equal(gated[:queries], want[:queries]) and not gated[queries:].any()
        assert lse_want[queries:].isneginf().all()
        got = sparse_decode_attention(*args, lse=lse_got, queries_per_request=queries, splits=splits, live=live)
        torch.testing.assert_close(got, gated, rtol=TOL, atol=TOL)
        torch.testing.assert_close(lse_got, lse_want, rtol=TOL, atol=TOL)
    if queries > 1:  # a tile's queries attend as decode queries of their request would, one by one
        per_query = [a.repeat_interleave(queries, 0) for a in args[3:4]] + args[4:5] + [
            a.repeat_interleave(queries, 0) for a in args[5:7]]
        lens_q = torch.tensor(lens).repeat_interleave(queries)
        starts = indptr[:-1].repeat_interleave(queries)
        window_q = torch.cat([window[a:a + n] for a, n in zip(starts.tolist(), lens_q.tolist())]).to(DEVICE)
        indptr_q = torch.cat([torch.zeros(1), lens_q.cumsum(0)]).int().to(DEVICE)
        one_by_one = sparse_decode_attention_reference(args[0], *args[1:3], *per_query, *args[7:9], indptr_q,
                                                       window_q, args[11])
        torch.testing.assert_close(want, one_by_one, rtol=TOL, atol=TOL)


# The suffix path's tiles hand the kernel the model's half-precision queries (bf16 on a GPU). Triton
# 3.9's interpreter computes bf16 dots wrongly (a 16x16 bf16 tl.dot is off by ~1e10 there; fp16 is
# exact), so on a CPU the same kernel path is checked with fp16 queries and keys.
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


@pytest.mark.parametrize("splits", [1, 3])
def test_half_queries_give_a_float32_output_as_their_float32_values_do(splits):
    """The suffix path's tiles: queries in the model's half precision, output and lse float32 for
    the merge, equal to attending with the same values upcast (half products are exact in float32)."""
    gen = torch.Generator().manual_seed(7)
    batch, hkv, group, d, c, queries = 2, 2, 4, 32, 8, 20
    q = torch.randn(batch * queries, hkv * group, d, generator=gen).to(HALF)
    blocks_k, blocks_v = (torch.randn(12 * hkv, c, d, generator=gen).to(HALF) for _ in range(2))
    outliers = torch.tensor([[[2, -1], [3, 5]], [[4, 9], [-1, -1]]], dtype=torch.int32)
    scratch_pages = torch.tensor([[6, 7, 8], [9, 10, 11]], dtype=torch.int32)
    entries = torch.tensor([[[0, 2, -1], [1, 0, 2]], [[2, -1, -1], [0, 1, -1]]], dtype=torch.int32)
    k_pool, v_pool = (torch.randn(40, hkv, d, generator=gen).to(HALF) for _ in range(2))
    no_window = torch.zeros(batch + 1, dtype=torch.int32)
    rest = [t.to(DEVICE) for t in (outliers, scratch_pages, torch.tensor([0, 1], dtype=torch.int32), entries,
                                   k_pool, v_pool, no_window, torch.zeros(1, dtype=torch.int32))]
    args = lambda dtype: [t.to(DEVICE).to(dtype) for t in (q, blocks_k, blocks_v)] + rest + [d ** -0.5]
    lse_got, lse_want = (torch.empty(batch * queries, hkv * group, device=DEVICE) for _ in range(2))
    got = sparse_decode_attention(*args(HALF), lse=lse_got, queries_per_request=queries, splits=splits,
                                  out_dtype=torch.float32)
    want = sparse_decode_attention_reference(*args(torch.float32), lse=lse_want, queries_per_request=queries)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    torch.testing.assert_close(lse_got, lse_want, rtol=TOL, atol=TOL)


def test_key_splits_fill_idle_sms_in_powers_of_two(monkeypatch):
    import sglang_shadowkv.kernels.key_splits as sda

    monkeypatch.setattr(sda, "sm_count", lambda device: 132)
    gpu = torch.device("cuda")
    assert sda.key_splits(8, 38, gpu) == 8  # 33 wanted, 9 allowed by the blocks: 8
    assert sda.key_splits(8, 200, gpu) == 16  # at most 16
    assert sda.key_splits(32, 38, gpu) == 8  # 9 wanted
    assert sda.key_splits(64, 38, gpu) == 4  # 5 wanted
    assert sda.key_splits(8, 3, gpu) == 1  # too few blocks to split
    assert sda.key_splits(67, 38, gpu) == 1  # the programs fill half the SMs
    assert sda.key_splits(128, 19, gpu, least=2) == 2  # a decode launch splits at least twice
    assert sda.key_splits(128, 7, gpu, least=2) == 1  # unless its blocks are too few
    assert sda.key_splits(8, 38, torch.device("cpu")) == 1


def test_decode_batches_and_suffix_tiles_take_their_own_launch(monkeypatch):
    import sglang_shadowkv.kernels.key_splits
    import sglang_shadowkv.kernels.sparse_decode_attention as sda

    monkeypatch.setattr(sglang_shadowkv.kernels.key_splits, "sm_count", lambda device: 132)
    gpu = torch.device("cuda")
    # 16 decoding requests, Llama-3.1-8B heads, 48 outliers and 256 entries of 8 tokens: 128-key
    # blocks (3 + 16), split twice; 16 tiles of 64 queries: 64-key blocks on 8 warps, not split
    assert sda.launch_for(*sda.program_rows(1, 4)) is sda.DECODE_LAUNCH
    assert sda.default_key_splits(16, 8, 1, 48, 256, 8, gpu, 4) == 2
    assert sda.launch_for(*sda.program_rows(64, 4)) is sda.TILE_LAUNCH
    assert sda.default_key_splits(16, 8, 64, 48, 256, 8, gpu, 4) == 1


def test_sparse_attention_of_nothing_is_zero_with_minus_infinite_lse():
    """A query with no outlier, no selected chunk and no window (a part of a merged attention that
    attends nothing) must merge as nothing: output 0, log-sum-exp -inf, never NaN."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 32, generator=gen)
    blocks = torch.randn(6, 8, 32, generator=gen)
    blocks[4:] = float("nan")  # page 2: the rows' scratch, never written
    scratch_pages = torch.full((2, 4), 2, dtype=torch.int32)
    pool = torch.randn(10, 2, 32, generator=gen)
    none = torch.full((2, 2, 4), -1, dtype=torch.int32)
    args = [t.to(DEVICE) for t in (q, blocks, blocks, none[:, :, :2], scratch_pages, torch.tensor([0, 1]).int(),
                                   none, pool, pool, torch.zeros(3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))]
    for fn in (sparse_decode_attention, functools.partial(sparse_decode_attention, splits=2),
               sparse_decode_attention_reference):
        lse = torch.zeros(2, 4, device=DEVICE)
        out = fn(*args, 0.2, lse=lse)
        assert (out == 0).all() and (lse == float("-inf")).all()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_chunk_cache_plan(data):
    k = data.draw(st.integers(1, 12))
    rows = data.draw(st.integers(1, 4))
    universe = st.integers(0, 30)
    held_rows, sel_rows = [], []
    for _ in range(rows):
        held = data.draw(st.lists(universe, max_size=k, unique=True))
        sel = data.draw(st.lists(universe, max_size=k, unique=True))
        held_rows.append(held + [-1] * (k - len(held)))
        sel_rows.append(sel + [-1] * (k - len(sel)))
    held, selected = torch.tensor(held_rows), torch.tensor(sel_rows)
    jobs, entries, new_held = plan_chunk_cache(held, selected)
    for i in range(rows):
        valid = selected[i] >= 0
        ent = entries[i][valid]
        assert torch.equal(new_held[i][ent], selected[i][valid])  # every selected chunk is held
        assert len(set(ent.tolist())) == len(ent)  # in distinct entries
        assert (entries[i][~valid] == -1).all()
        misses = set(selected[i][valid].tolist()) - set(held[i].tolist())
        assert sorted(jobs[i][jobs[i] >= 0].tolist()) == sorted(misses)  # only misses are fetched
        kept = new_held[i][jobs[i] < 0]
        assert torch.equal(kept, held[i][jobs[i] < 0])  # other entries untouched


@pytest.mark.parametrize("chunk_size,head_dim,num_chunks", [(8, 64, 37), (4, 32, 16), (5, 48, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_stats(chunk_size, head_dim, num_chunks, dtype):
    gen = torch.Generator().manual_seed(chunk_size * 1000 + head_dim + num_chunks)
    k = torch.randn(num_chunks * chunk_size, 3, head_dim, generator=gen) + torch.randn(1, 3, head_dim, generator=gen)
    k[:chunk_size, 1] = 0  # a chunk of zero keys: cosine is 0, not nan
    k = k.to(dtype).to(DEVICE)
    (lm, cos), (lm_ref, cos_ref) = chunk_stats(k, chunk_size), chunk_stats_reference(k, chunk_size)
    assert lm.dtype == cos.dtype == torch.float32 and cos.shape == (num_chunks, 3)
    torch.testing.assert_close(lm, lm_ref, rtol=TOL, atol=TOL)
    torch.testing.assert_close(cos, cos_ref, rtol=TOL, atol=TOL)
    assert cos[0, 1] == 0 and (cos[:, 0] > -1).all() and (cos <= 1 + 1e-5).all()


def test_a_documents_length_compiles_no_new_variant_of_the_compression_kernels():
    """Triton specializes an int argument on divisibility by 16; the kernels a compression runs
    per layer take the document's token or chunk count, so each is left unspecialized: the
    server's warmup compiles one variant and a document of any length reuses it (a chunk count not
    divisible by 16 compiled another in the first compression while serving, 0.33 s on the H100)."""
    import os
    import subprocess
    import sys

    check = ("from sglang_shadowkv.kernels.chunk_stats import _chunk_stats_kernel as a\n"
             "from sglang_shadowkv.kernels.rotary import _rotate_kernel as b\n"
             "print(all(n in k.arg_names and n in k.do_not_specialize for k, n in ((a, 'N'), (b, 'T'))))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler's JIT functions
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


def test_chunk_stats_rejects_a_partial_chunk():
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_stats(torch.zeros(10, 1, 16, device=DEVICE), 8)


@pytest.mark.parametrize("tokens,heads,head_dim,rotary_dim", [(70, 3, 64, 64), (5, 1, 32, 32), (130, 2, 48, 48),
                                                               (40, 2, 64, 32)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rotate(tokens, heads, head_dim, rotary_dim, inverse):
    """With partial rotary (GLM: half of each head) the unrotated dims pass through bit for bit."""
    gen = torch.Generator().manual_seed(tokens * 10 + head_dim + inverse)
    rotary = RotaryEmbedding(head_dim, 10000.0, 4096, rotary_dim=rotary_dim)
    x = torch.randn(tokens, heads, head_dim, generator=gen).to(torch.bfloat16)
    pos = torch.randint(0, 4096, (tokens,), generator=gen)
    args = [t.to(DEVICE) for t in (x, rotary.cos_cache, rotary.sin_cache, pos)]
    got = rotate(*args, inverse=inverse, out_dtype=torch.float32)
    want = rotate_reference(*args, inverse=inverse, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    back = rotate(got, *args[1:], inverse=not inverse)  # the inverse undoes the rotation
    torch.testing.assert_close(back, x.float().to(DEVICE), rtol=TOL, atol=TOL)
    assert rotate(*args).dtype == torch.bfloat16
    unrotated = _unrotated_dims(head_dim, rotary_dim)
    for out in (got, want):
        assert torch.equal(out[..., unrotated], x.float().to(DEVICE)[..., unrotated])


def _unrotated_dims(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The dims partial rotary leaves: table columns rotary_dim/2 .. head_dim/2 of each half."""
    half = torch.arange(rotary_dim // 2, head_dim // 2)
    return torch.cat([half, half + head_dim // 2])


@pytest.mark.parametrize("k", [5, 16, 40])
def test_chunk_cache_plan_in_place(k):
    """The one-kernel plan against the reference: same jobs, entries and held rows, on fresh random
    scratch maps (unique chunks, empty entries) and selections (hits, misses, padding), only the
    requests' rows touched."""
    from sglang_shadowkv.kernels.chunk_cache_plan import plan_chunk_cache_in_place, plan_chunk_cache_in_place_reference

    gen = torch.Generator().manual_seed(k)
    rows_total, r, h = 6, 4, 3
    held = torch.full((rows_total, h, k), -1, dtype=torch.int64)
    for i in range(rows_total):
        for j in range(h):
            chunks = torch.randperm(3 * k, generator=gen)[:k]
            held[i, j] = torch.where(torch.rand(k, generator=gen) < 0.25, -1, chunks)
    selected = torch.full((r, h, k), -1, dtype=torch.int64)
    for i in range(r):
        for j in range(h):
            n = int(torch.randint(0, k + 1, (1,), generator=gen))
            selected[i, j, :n] = torch.randperm(3 * k, generator=gen)[:n]
    rows = torch.tensor([5, 0, 3, 1], dtype=torch.int32)
    held, selected, rows = held.to(DEVICE), selected.to(DEVICE), rows.to(DEVICE)
    hits_before = torch.randint(0, 9, (rows_total, 2), generator=gen).to(DEVICE)
    want_held, want_hits = held.clone(), hits_before.clone()
    want = plan_chunk_cache_in_place_reference(want_held, rows, selected, hits=want_hits)
    got_held, got_hits = held.clone(), hits_before.clone()
    got = plan_chunk_cache_in_place(got_held, rows, selected, hits=got_hits)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got_held, want_held)
    assert torch.equal(got_hits, want_hits)
    # the counts: per request, the selected chunks its row held before (hits) and all selected (lookups)
    for i, row in enumerate(rows.tolist()):
        chosen = [(j, c) for j in range(h) for c in selected[i, j].tolist() if c >= 0]
        counted = torch.tensor([sum(c in held[row, j].tolist() for j, c in chosen), len(chosen)])
        assert torch.equal((want_hits[row] - hits_before[row]).cpu(), counted)
    assert torch.equal(got_held[[2, 4]], held[[2, 4]])  # rows no request names are left alone
    live = torch.tensor([2], dtype=torch.int32, device=DEVICE)  # requests 2 and 3: a CUDA graph's padding
    want_held, got_held = held.clone(), held.clone()
    want = plan_chunk_cache_in_place_reference(want_held, rows, selected, live)
    got = plan_chunk_cache_in_place(got_held, rows, selected, live)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and torch.equal(got_held, want_held)
    assert (want[0][2:] == -1).all() and (want[1][2:] == -1).all()
    assert torch.equal(got_held[[2, 3, 4]], held[[2, 3, 4]])  # the padding's rows are left alone too


@pytest.mark.parametrize("num_chunks,group,adaptive", [(37, 4, True), (300, 2, True), (300, 4, False), (1100, 1, True)])
def test_select_decode_chunks(num_chunks, group, adaptive):
    """The one-kernel decode selection against the torch path: the same set of chunk slots per
    (request, KV head) and the same budget histogram, on fresh random logits (sharp and flat
    heads, chunks that are not selectable, budgets from the floor to the cap, padding rows with
    nothing selectable)."""
    from sglang_shadowkv.kernels.chunk_selection import select_decode_chunks, select_decode_chunks_reference

    gen = torch.Generator().manual_seed(num_chunks + group)
    b, h, width, layers, layer, floor = 5, 3, 80, 4, 2, 8
    top_k = min(64, num_chunks)  # the columns ranked: never more than the chunks
    spread = torch.tensor([0.5, 4.0, 12.0, 1.0, 30.0])[:, None, None]  # flat to sharp heads
    logits = torch.randn(b, h * group, num_chunks, generator=gen) * spread
    not_selectable = torch.rand(b, h, num_chunks, generator=gen) < 0.1
    not_selectable[4] = True  # a padding row: nothing to choose
    logits = logits.masked_fill(not_selectable.repeat_interleave(group, 1), float("-inf"))
    slots = torch.randperm(10 * num_chunks, generator=gen)[:b * num_chunks].view(b, num_chunks).int()
    budgets = torch.tensor([top_k, 17, min(top_k, num_chunks // 2), 3, top_k])
    rows = torch.tensor([3, 0, 6, 2, 5], dtype=torch.int32)
    top_p = 0.9 if adaptive else None
    hist = torch.zeros(8, layers, width + 1, dtype=torch.int64)
    args = [t.to(DEVICE) for t in (logits, slots, budgets)]
    want_hist, got_hist = hist.to(DEVICE).clone(), hist.to(DEVICE).clone()  # (.to alone: one tensor on a CPU)
    want = select_decode_chunks_reference(args[0], h, args[1], args[2], top_k, width, top_p, floor, want_hist,
                                          rows.to(DEVICE), layer)
    got = select_decode_chunks(args[0], h, args[1], args[2], top_k, width, top_p, floor, got_hist,
                               rows.to(DEVICE), layer)
    want[4] = -1  # the reference pads a budget with chunks that cannot be chosen; the kernel never picks them
    want_hist[5, layer] = 0
    want_hist[5, layer, 0] = h
    assert got.shape == want.shape
    for i in range(b):
        for j in range(h):
            assert set(got[i, j].tolist()) == set(want[i, j].tolist()), (i, j)
            n = int((got[i, j] >= 0).sum())
            assert (got[i, j, n:] == -1).all()
    assert torch.equal(got_hist, want_hist)
    counts = (got[:4] >= 0).sum(-1).cpu()
    assert adaptive == bool((counts < budgets[:4, None]).any())  # the adaptive budget took fewer than the cap
    live = torch.tensor([2], dtype=torch.int32, device=DEVICE)  # rows 2.. are a CUDA graph's padding
    gated_hist = hist.to(DEVICE).clone()
    gated = select_decode_chunks(args[0], h, args[1], args[2], top_k, width, top_p, floor, gated_hist,
                                 rows.to(DEVICE), layer, live)
    assert torch.equal(gated[:2], got[:2]) and (gated[2:] == -1).all()
    want_hist = hist.to(DEVICE).clone()
    select_decode_chunks_reference(args[0], h, args[1], args[2], top_k, width, top_p, floor, want_hist,
                                   rows.to(DEVICE), layer, live)
    assert torch.equal(gated_hist, want_hist) and gated_hist[rows[2:].long()].sum() == 0


@pytest.mark.parametrize("chunk_size,head_dim", [(8, 128), (4, 48), (3, 16)])
def test_quantize_chunks(chunk_size, head_dim):
    """The one-pass int8 host format equals the torch path's bit for bit: values, ties rounded to
    even, scales; from a strided token-major view (the dense pool's), with an all-zero chunk."""
    from sglang_shadowkv.kernels.quantize_chunks import quantize_chunks, quantize_chunks_reference

    gen = torch.Generator().manual_seed(chunk_size + head_dim)
    tokens, heads = 5 * chunk_size, 3
    v = torch.randn(tokens, heads + 1, head_dim, generator=gen) * torch.logspace(-3, 2, tokens)[:, None, None]
    v[:chunk_size, 1] = 0  # a chunk of zeros: scale at its floor, all zero
    v[chunk_size:2 * chunk_size, 2, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale 1: ties at .5
    v = v.bfloat16().to(DEVICE)[:, :heads]  # a strided view, as the pool's values are
    got_values, got_scale = quantize_chunks(v, chunk_size)
    want_values, want_scale = quantize_chunks_reference(v, chunk_size)
    assert got_values.dtype == torch.int8 and got_values.shape == (5, heads, chunk_size, head_dim)
    torch.testing.assert_close(got_scale, want_scale, rtol=0, atol=0)
    assert torch.equal(got_values, want_values)
    assert got_values[1, 2, 0, :4].tolist() == [127, 0, 2, -2]
    with pytest.raises(ValueError, match="multiple of"):
        quantize_chunks(v[:-1], chunk_size)
