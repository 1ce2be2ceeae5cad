"""Rebuild the post-RoPE keys of selected chunks from their low-rank rows: K = RoPE(A[tokens] · B).

Pool layout: chunk slot s owns the low-rank rows a_rows[s*c : s*c+c] (rank R, zero-padded past the
layer's rank), its first token sits at position chunk_pos[s], and its segment's basis is
basis[chunk_basis[s]] (R × Hkv·D, the KV head's D columns used for that head). A segment's rank
may be below R (the energy rule picks it per layer): with `basis_rank` [bases] only its first
basis_rank[chunk_basis[s]] columns are read, so a rank-33 layer costs a third of a rank-96 one
in a pool 96 wide. Each job
(b, h, e) names the chunk slot to write into scratch entry e of KV head h of scratch row
scratch_rows[b]; -1 means the entry already holds what is needed (a chunk-cache hit).
RoPE is the half-split convention (first half rotates with the second).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_shadowkv.kernels.rotary import rotate_reference


def rebuild_keys_reference(a_rows, basis, cos, sin, chunk_pos, chunk_basis, jobs, scratch_k,
                           scratch_rows, chunk_size, basis_rank=None):
    """Writes scratch_k[scratch_rows[b], h, e] for every job >= 0; returns scratch_k."""
    b_idx, h_idx, e_idx = (jobs >= 0).nonzero(as_tuple=True)
    if b_idx.numel() == 0:
        return scratch_k
    d = scratch_k.shape[-1]
    slots = jobs[b_idx, h_idx, e_idx].long()
    tokens = slots[:, None] * chunk_size + torch.arange(chunk_size, device=slots.device)
    a = a_rows[tokens].float()  # [J, c, R]
    if basis_rank is not None:  # columns past the segment's rank are not read
        rank = basis_rank[chunk_basis[slots].long()].long()
        a = a * (torch.arange(a.shape[2], device=a.device) < rank[:, None])[:, None, :]
    per_head = basis.unflatten(2, (-1, d)).transpose(1, 2)  # [bases, Hkv, R, D]: each job reads its head's
    k = torch.bmm(a, per_head[chunk_basis[slots].long(), h_idx].float())  # [J, c, D] pre-RoPE
    pos = chunk_pos[slots].long()[:, None] + torch.arange(chunk_size, device=slots.device)
    k = rotate_reference(k.reshape(-1, 1, d), cos, sin, pos.flatten()).view_as(k)
    scratch_k[scratch_rows[b_idx].long(), h_idx, e_idx] = k.to(scratch_k.dtype)
    return scratch_k


@triton.jit
def _rebuild_keys_kernel(A, BASIS, COS, SIN, CHUNK_POS, CHUNK_BASIS, BASIS_RANK, JOBS, OUT, ROWS, RANK,
                         stride_a, stride_bb, stride_br, stride_cos,
                         stride_jb, stride_jh, stride_or, stride_oh, stride_oe, stride_ot,
                         CHUNK: tl.constexpr, CHUNK_PAD: tl.constexpr, HALF: tl.constexpr,
                         BLOCK_R: tl.constexpr, RANKED: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    e = tl.program_id(2)
    slot = tl.load(JOBS + b * stride_jb + h * stride_jh + e)
    if slot >= 0:
        slot = slot.to(tl.int64)
        offs_t = tl.arange(0, CHUNK_PAD)
        t_valid = offs_t < CHUNK
        offs_h = tl.arange(0, HALF)
        basis_id = tl.load(CHUNK_BASIS + slot).to(tl.int64)
        rank = RANK
        if RANKED:
            rank = tl.minimum(tl.load(BASIS_RANK + basis_id), RANK)
        col = h * 2 * HALF + offs_h
        acc1 = tl.zeros([CHUNK_PAD, HALF], tl.float32)
        acc2 = tl.zeros([CHUNK_PAD, HALF], tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_valid = offs_r < rank
            a = tl.load(A + (slot * CHUNK + offs_t)[:, None] * stride_a + offs_r[None, :],
                        mask=t_valid[:, None] & r_valid[None, :], other=0.0).to(tl.float32)
            bp = BASIS + basis_id * stride_bb + offs_r[:, None] * stride_br
            b1 = tl.load(bp + col[None, :], mask=r_valid[:, None], other=0.0).to(tl.float32)
            b2 = tl.load(bp + (col + HALF)[None, :], mask=r_valid[:, None], other=0.0).to(tl.float32)
            acc1 += tl.dot(a, b1)
            acc2 += tl.dot(a, b2)
        pos = tl.load(CHUNK_POS + slot).to(tl.int64) + offs_t
        c = tl.load(COS + pos[:, None] * stride_cos + offs_h[None, :], mask=t_valid[:, None], other=1.0)
        s = tl.load(SIN + pos[:, None] * stride_cos + offs_h[None, :], mask=t_valid[:, None], other=0.0)
        row = tl.load(ROWS + b).to(tl.int64)
        out = OUT + row * stride_or + h * stride_oh + e * stride_oe + offs_t[:, None] * stride_ot
        ty = OUT.dtype.element_ty
        tl.store(out + offs_h[None, :], (acc1 * c - acc2 * s).to(ty), mask=t_valid[:, None])
        tl.store(out + (offs_h + HALF)[None, :], (acc2 * c + acc1 * s).to(ty), mask=t_valid[:, None])


def rebuild_keys(a_rows, basis, cos, sin, chunk_pos, chunk_basis, jobs, scratch_k, scratch_rows,
                 chunk_size, basis_rank=None):
    """Triton version of `rebuild_keys_reference` (same arguments)."""
    b, hkv, e = jobs.shape
    d = scratch_k.shape[-1]
    if jobs.numel() == 0:
        return scratch_k
    if basis.stride(2) != 1 or a_rows.stride(1) != 1 or cos.stride(1) != 1:
        raise ValueError("a_rows, basis and cos/sin must be contiguous in their last dimension")
    _rebuild_keys_kernel[(b, hkv, e)](
        a_rows, basis, cos, sin, chunk_pos, chunk_basis, chunk_basis if basis_rank is None else basis_rank,
        jobs, scratch_k, scratch_rows, a_rows.shape[1],  # (BASIS_RANK unread without ranks)
        a_rows.stride(0), basis.stride(0), basis.stride(1), cos.stride(0),
        jobs.stride(0), jobs.stride(1), scratch_k.stride(0), scratch_k.stride(1), scratch_k.stride(2),
        scratch_k.stride(3),
        CHUNK=chunk_size, CHUNK_PAD=max(16, triton.next_power_of_2(chunk_size)), HALF=d // 2, BLOCK_R=32,
        RANKED=basis_rank is not None)
    return scratch_k
