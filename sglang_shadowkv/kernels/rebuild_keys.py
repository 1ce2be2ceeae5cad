"""Rebuild the post-RoPE keys of selected chunks from their low-rank rows: K = RoPE(A[tokens] · B).

Pool layout (mem_cache/compressed_pool.py keeps it inside the dense KV pool's pages): chunk slot s
owns the low-rank rows of its c tokens, their first L columns in a_lo[s] [c, L] and the rest in
a_hi[s] [c, R - L] (zero past the layer's rank); its first token sits at position chunk_pos[s] and
its segment's basis is basis id chunk_basis[s]. A basis (R rows of Hkv·D, the KV head's D columns
used for that head) lies in pages 2c rows at a time: rows 2c·i .. 2c·i + c - 1 in
k_pages[basis_pages[b, i]] and the next c in v_pages[basis_pages[b, i]] (k_pages / v_pages: the
pool's K and V memory as [pages, c, Hkv·D]). A segment's rank may be below R (the energy rule
picks it per layer): with `basis_rank` [bases] only its first basis_rank[b] columns are read, so
a rank-33 layer costs a third of a rank-96 one. Each job (b, h, e) names the chunk slot to write
into scratch entry e of KV head h of scratch row scratch_rows[b]: block
scratch_pages[scratch_rows[b], e]·Hkv + h of blocks_k, the pool's K memory as [c, D] blocks
(kernels/scratch_blocks.py); -1 means the entry already holds what is needed (a chunk-cache hit).
RoPE is the half-split convention (first half rotates with the second).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_shadowkv.kernels.head_dims import dim_pad, head_dims
from sglang_shadowkv.kernels.padding_rows import live_row, live_rows
from sglang_shadowkv.kernels.rotary import rotate_reference
from sglang_shadowkv.kernels.scratch_blocks import scratch_block, scratch_jobs

ROWS_PER_PROGRAM = 128  # key rows a program rebuilds together (entries x chunk tokens): one tensor-core tile
# low-rank columns per step of a program's loop, its warps and pipeline stages (None: Triton's
# default). On the H100 (maintainers/experiments/tune_decode_kernels.py, 16 requests x 256 chunks per KV head)
# 64 columns in one stage took 163 µs a layer against 190 for 32 in Triton's default 3; 8 warps
# and 64-row programs failed to compile there (Triton 3.6)
RANK_BLOCK, WARPS, STAGES = 64, 4, 1


def basis_rows_reference(k_pages, v_pages, basis_pages, bases, rank):
    """[len(bases), rank, Hkv·D] rows of the given bases, read from their pages."""
    pages = basis_pages[bases.long()].long()  # [n, pages per basis]
    return torch.stack([k_pages[pages], v_pages[pages]], 2).flatten(1, 3)[:, :rank]


def rebuild_keys_reference(a_lo, a_hi, k_pages, v_pages, basis_pages, cos, sin, chunk_pos, chunk_basis, jobs,
                           blocks_k, scratch_pages, scratch_rows, basis_rank=None, live=None):
    """Writes the scratch entry (b, h, e) in blocks_k for every job >= 0 of rows before live
    (padding_rows); returns blocks_k."""
    n = live_rows(live, jobs.shape[0])
    slots, h_idx, blocks = scratch_jobs(jobs[:n], scratch_pages, scratch_rows[:n])
    if slots.numel() == 0:
        return blocks_k
    c, d = blocks_k.shape[-2], blocks_k.shape[-1]
    a = torch.cat([a_lo[slots], a_hi[slots]], 2).float()  # [J, c, R]
    bases, which = chunk_basis[slots].long().unique(return_inverse=True)
    basis = basis_rows_reference(k_pages, v_pages, basis_pages, bases, a.shape[2])  # [n, R, Hkv·D]
    if basis_rank is not None:  # columns past the segment's rank are not read
        rank = basis_rank[chunk_basis[slots].long()].long()
        a = a * (torch.arange(a.shape[2], device=a.device) < rank[:, None])[:, None, :]
    per_head = basis.unflatten(2, (-1, d)).transpose(1, 2)  # [n, Hkv, R, D]: each job reads its head's
    k = torch.bmm(a, per_head[which, h_idx].float())  # [J, c, D] pre-RoPE
    pos = chunk_pos[slots].long()[:, None] + torch.arange(c, device=slots.device)
    k = rotate_reference(k.reshape(-1, 1, d), cos, sin, pos.flatten()).view_as(k)
    blocks_k[blocks] = k.to(blocks_k.dtype)
    return blocks_k


@triton.jit
def _accumulate(acc1, acc2, a_ptrs, a_mask, kp, vp, offs_r, r_valid, page_ids, col, col_ok,
                stride_pp, stride_pt, CHUNK: tl.constexpr, HALF: tl.constexpr):
    """acc += A[:, offs_r] · B[offs_r, col] (first half) and B[offs_r, col + HALF] (second half);
    a_ptrs [M, BLOCK_R] point at A's entries (rows of other bases masked to zero); B's rows come
    from their basis pages (col_ok: the columns that are real dims)."""
    a = tl.load(a_ptrs, mask=a_mask, other=0.0)
    half = (offs_r // CHUNK) % 2  # 0: the row is in the page's K memory, 1: in its V memory
    row = page_ids * stride_pp + (offs_r % CHUNK) * stride_pt
    k_mask = (r_valid & (half == 0))[:, None] & col_ok[None, :]
    v_mask = (r_valid & (half == 1))[:, None] & col_ok[None, :]
    b1 = (tl.load(kp + row[:, None] + col[None, :], mask=k_mask, other=0.0)
          + tl.load(vp + row[:, None] + col[None, :], mask=v_mask, other=0.0))
    b2 = (tl.load(kp + row[:, None] + (col + HALF)[None, :], mask=k_mask, other=0.0)
          + tl.load(vp + row[:, None] + (col + HALF)[None, :], mask=v_mask, other=0.0))
    return acc1 + tl.dot(a, b1), acc2 + tl.dot(a, b2)


@triton.jit
def _rebuild_keys_kernel(A_LO, A_HI, KP, VP, BASIS_PAGES, COS, SIN, CHUNK_POS, CHUNK_BASIS, BASIS_RANK, JOBS,
                         OUT, SCRATCH_PAGES, ROWS, LIVE, RANK, LO, ENTRIES,
                         stride_lo_s, stride_lo_t, stride_hi_s, stride_hi_t, stride_pp, stride_pt, stride_bp,
                         stride_cos, stride_jb, stride_jh, stride_ob, stride_ot, stride_sp,
                         CHUNK: tl.constexpr, CHUNK_PAD: tl.constexpr, HALF: tl.constexpr,
                         HALF_PAD: tl.constexpr, BLOCK_E: tl.constexpr, ENTRIES_PAD: tl.constexpr,
                         BLOCK_R: tl.constexpr, RANKED: tl.constexpr, GATED: tl.constexpr):
    """One program: BLOCK_E misses of one (request, KV head), BLOCK_E·CHUNK_PAD key rows as one
    tile, so each basis block is read once for all of them and multiplied on tensor cores (one
    program per entry re-read its head's whole basis for 8 keys: 0.39 ms a layer for 16 decoding
    requests at the 256-chunk cap on the H200, 0.16 ms this way). Program i takes the misses
    i·BLOCK_E.. of the head's jobs in entry order, not entries i·BLOCK_E..: the hits are spread
    over the entries, and tiles of entries (their hits' rows masked) took 0.24 against 0.13 ms a
    layer for 32 rows of 32K at 61% hits on the H100. Entries of one request may come from
    segments with different bases (a chat's turns): one pass per distinct basis, the other rows
    masked out of it."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    if not live_row(LIVE, b, GATED):
        return
    offs_e = tl.arange(0, ENTRIES_PAD)
    row_jobs = tl.load(JOBS + b * stride_jb + h * stride_jh + offs_e, mask=offs_e < ENTRIES, other=-1)
    miss = row_jobs >= 0
    first = tl.program_id(2) * BLOCK_E
    if tl.sum(miss.to(tl.int32), 0) > first:
        # the entry of each of this program's misses (ENTRIES_PAD: none of them)
        rank_of = tl.cumsum(miss.to(tl.int32), 0) - 1
        wanted = first + tl.arange(0, BLOCK_E)
        pick = miss[None, :] & (rank_of[None, :] == wanted[:, None])  # [BLOCK_E, ENTRIES_PAD]
        mine = tl.min(tl.where(pick, offs_e[None, :], ENTRIES_PAD), 1)
        offs_m = tl.arange(0, BLOCK_E * CHUNK_PAD)
        entry = tl.gather(mine, offs_m // CHUNK_PAD, 0)
        t = offs_m % CHUNK_PAD
        slot = tl.load(JOBS + b * stride_jb + h * stride_jh + entry, mask=entry < ENTRIES, other=-1).to(tl.int64)
        todo = (slot >= 0) & (t < CHUNK)
        basis = tl.load(CHUNK_BASIS + slot, mask=todo, other=0).to(tl.int64)
        offs_h, h_ok = head_dims(HALF, HALF_PAD)
        col = h * 2 * HALF + offs_h
        acc1 = tl.zeros([BLOCK_E * CHUNK_PAD, HALF_PAD], tl.float32)
        acc2 = tl.zeros([BLOCK_E * CHUNK_PAD, HALF_PAD], tl.float32)
        lo_rows = A_LO + slot[:, None] * stride_lo_s + t[:, None] * stride_lo_t
        hi_rows = A_HI + slot[:, None] * stride_hi_s + t[:, None] * stride_hi_t
        remaining = todo
        while tl.max(remaining.to(tl.int32), 0) > 0:
            basis_id = tl.min(tl.where(remaining, basis, 1 << 40), 0)  # the smallest basis id still to do
            rows = remaining & (basis == basis_id)
            rank = RANK
            if RANKED:
                rank = tl.minimum(tl.load(BASIS_RANK + basis_id), RANK)
            lo_end = tl.minimum(rank, LO)
            for r0 in range(0, lo_end, BLOCK_R):  # columns held in the slot's K share
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_valid = offs_r < lo_end
                pages = tl.load(BASIS_PAGES + basis_id * stride_bp + offs_r // (2 * CHUNK), mask=r_valid, other=0)
                acc1, acc2 = _accumulate(acc1, acc2, lo_rows + offs_r[None, :], rows[:, None] & r_valid[None, :],
                                         KP, VP, offs_r, r_valid, pages.to(tl.int64), col, h_ok, stride_pp,
                                         stride_pt, CHUNK, HALF)
            for r0 in range(LO, rank, BLOCK_R):  # the rest, in its V share
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_valid = offs_r < rank
                pages = tl.load(BASIS_PAGES + basis_id * stride_bp + offs_r // (2 * CHUNK), mask=r_valid, other=0)
                acc1, acc2 = _accumulate(acc1, acc2, hi_rows + (offs_r - LO)[None, :], rows[:, None] & r_valid[None, :],
                                         KP, VP, offs_r, r_valid, pages.to(tl.int64), col, h_ok, stride_pp,
                                         stride_pt, CHUNK, HALF)
            remaining = remaining & (basis != basis_id)
        pos = tl.load(CHUNK_POS + slot, mask=todo, other=0).to(tl.int64) + t
        keep = todo[:, None] & h_ok[None, :]
        c = tl.load(COS + pos[:, None] * stride_cos + offs_h[None, :], mask=keep, other=1.0)
        s = tl.load(SIN + pos[:, None] * stride_cos + offs_h[None, :], mask=keep, other=0.0)
        row = tl.load(ROWS + b).to(tl.int64)
        block = scratch_block(SCRATCH_PAGES, stride_sp, row, tl.where(todo, entry, 0), h, tl.num_programs(1))
        out = OUT + block[:, None] * stride_ob + t[:, None] * stride_ot
        ty = OUT.dtype.element_ty
        tl.store(out + offs_h[None, :], (acc1 * c - acc2 * s).to(ty), mask=keep)
        tl.store(out + (offs_h + HALF)[None, :], (acc2 * c + acc1 * s).to(ty), mask=keep)


def rebuild_keys(a_lo, a_hi, k_pages, v_pages, basis_pages, cos, sin, chunk_pos, chunk_basis, jobs, blocks_k,
                 scratch_pages, scratch_rows, basis_rank=None, live=None):
    """Triton version of `rebuild_keys_reference` (same arguments)."""
    b, hkv, e = jobs.shape
    c, d = blocks_k.shape[-2], blocks_k.shape[-1]
    if jobs.numel() == 0:
        return blocks_k
    if a_lo.stride(2) != 1 or (a_hi.shape[2] and a_hi.stride(2) != 1) or k_pages.stride(2) != 1 \
            or k_pages.stride() != v_pages.stride() or cos.stride(1) != 1 or blocks_k.stride(2) != 1 \
            or scratch_pages.stride(1) != 1:
        raise ValueError("a_lo, a_hi, the pages, cos/sin, blocks_k and scratch_pages must be contiguous in their "
                         "last dimension, k_pages and v_pages laid out alike")
    lo = a_lo.shape[2]
    chunk_pad = triton.next_power_of_2(c)
    block_e = max(1, ROWS_PER_PROGRAM // chunk_pad)
    _rebuild_keys_kernel[(b, hkv, triton.cdiv(e, block_e))](
        a_lo, a_hi if a_hi.numel() else a_lo, k_pages, v_pages, basis_pages, cos, sin, chunk_pos, chunk_basis,
        chunk_basis if basis_rank is None else basis_rank,  # (BASIS_RANK unread without ranks)
        jobs, blocks_k, scratch_pages, scratch_rows, scratch_rows if live is None else live,  # (LIVE unread ungated)
        lo + a_hi.shape[2], lo, e,
        a_lo.stride(0), a_lo.stride(1), a_hi.stride(0), a_hi.stride(1), k_pages.stride(0), k_pages.stride(1),
        basis_pages.stride(0), cos.stride(0), jobs.stride(0), jobs.stride(1),
        blocks_k.stride(0), blocks_k.stride(1), scratch_pages.stride(0),
        CHUNK=c, CHUNK_PAD=chunk_pad, HALF=d // 2, HALF_PAD=dim_pad(d // 2), BLOCK_E=block_e,
        ENTRIES_PAD=triton.next_power_of_2(e), BLOCK_R=RANK_BLOCK,
        RANKED=basis_rank is not None, GATED=live is not None, num_warps=WARPS,
        **({} if STAGES is None else {"num_stages": STAGES}))
    return blocks_k
