"""Raw landmark logits of one decode query per request: q · landmark for every chunk of the request;
and a suffix tile's chunk mass (its queries' softmax over the chunks, summed), fused.

Landmarks live in a pool [chunk_slots, Hkv, D] beside a mask selectable [chunk_slots, Hkv] (0 for
outlier chunks and for the padding slot); request b's chunks are chunk_slots[b, :]. The softmax over chunks and the max over the query
heads of a KV group are done by the caller on this small output: one pass over the landmarks,
which dominate the bytes a ShadowKV decode step reads. An int8 landmark pool comes with a float32
scale per chunk slot and KV head, applied to each dot product: half the bytes of bf16 landmarks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_shadowkv.kernels.head_dims import dim_pad, head_dims
from sglang_shadowkv.kernels.padding_rows import live_row
from sglang_shadowkv.kernels.sparse_decode_attention import program_rows

SCORE_QUERY_BLOCK = 16  # queries per program of the tile scoring kernels (their [rows, BLOCK_N] logits stay small)


def landmark_logits_reference(q, landmarks, chunk_slots, selectable, sm_scale, scale=None, live=None):
    """q [B, Hq, D]; landmarks [S, Hkv, D]; chunk_slots [B, N] int; selectable [S, Hkv] int8;
    scale [S, Hkv] (int8 landmarks) -> [B, Hq, N] float32 logits, -inf where the chunk is not
    selectable for that KV head. live (a one-element tensor): rows from live on are a CUDA graph's
    padding and their logits are left unspecified (computed here, skipped by the kernel)."""
    b, hq, d = q.shape
    hkv = landmarks.shape[1]
    slots = chunk_slots.long()
    lm = landmarks[slots].float()  # [B, N, Hkv, D]
    if scale is not None:
        lm = lm * scale[slots][..., None]
    logits = torch.einsum("bhgd,bnhd->bhgn", q.float().view(b, hkv, hq // hkv, d), lm) * sm_scale
    allowed = selectable[slots].permute(0, 2, 1).bool()  # [B, Hkv, N]
    logits = logits.masked_fill(~allowed[:, :, None, :], float("-inf"))
    return logits.reshape(b, hq, -1)


@triton.jit
def _landmark_logits_kernel(Q, L, SLOTS, SEL, SCALE, OUT, LIVE, sm_scale, N,
                            stride_qb, stride_qh, stride_ls, stride_lh, stride_sb,
                            stride_sel, stride_scale, stride_ob, stride_oh,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                            DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr, GATED: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    nb = tl.program_id(2)
    if not live_row(LIVE, b, GATED):
        return
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d, d_ok = head_dims(HEAD_DIM, DIM_PAD)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    g_valid = offs_g < GROUP
    n_valid = offs_n < N
    q = tl.load(Q + b * stride_qb + (h * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=g_valid[:, None] & d_ok[None, :], other=0.0)
    slot = tl.load(SLOTS + b * stride_sb + offs_n, mask=n_valid, other=0).to(tl.int64)
    lm = tl.load(L + slot[None, :] * stride_ls + h * stride_lh + offs_d[:, None],
                 mask=n_valid[None, :] & d_ok[:, None], other=0.0)
    s = tl.dot(q, lm.to(q.dtype)).to(tl.float32) * sm_scale  # int8 values are exact in q's dtype
    if SCALED:
        s *= tl.load(SCALE + slot * stride_scale + h, mask=n_valid, other=0.0)[None, :]
    sel = tl.load(SEL + slot * stride_sel + h, mask=n_valid, other=0)
    s = tl.where(sel[None, :] != 0, s, float("-inf"))
    tl.store(OUT + b * stride_ob + (h * GROUP + offs_g)[:, None] * stride_oh + offs_n[None, :], s,
             mask=g_valid[:, None] & n_valid[None, :])


def landmark_logits(q, landmarks, chunk_slots, selectable, sm_scale, scale=None, live=None, block_n: int = 64):
    """Triton version of `landmark_logits_reference` (same arguments)."""
    b, hq, d = q.shape
    hkv = landmarks.shape[1]
    n = chunk_slots.shape[1]
    out = torch.empty((b, hq, n), dtype=torch.float32, device=q.device)
    if b == 0 or n == 0:
        return out
    if scale is not None and scale.stride(1) != 1:
        raise ValueError("scale must be contiguous over KV heads")
    group = hq // hkv
    grid = (b, hkv, triton.cdiv(n, block_n))
    _landmark_logits_kernel[grid](
        q, landmarks, chunk_slots, selectable,
        selectable if scale is None else scale, out,  # (SCALE unread if unscaled, LIVE without a gate)
        chunk_slots if live is None else live, sm_scale, n,
        q.stride(0), q.stride(1), landmarks.stride(0), landmarks.stride(1), chunk_slots.stride(0),
        selectable.stride(0), 0 if scale is None else scale.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=program_rows(1, group)[1], HEAD_DIM=d, DIM_PAD=dim_pad(d), BLOCK_N=block_n,
        SCALED=scale is not None, GATED=live is not None)
    return out


# ---- a suffix tile's selection: landmark mass summed over its queries -------------------------------
def tile_landmark_mass_reference(q, q_valid, landmarks, chunk_slots, selectable, sm_scale, scale=None):
    """q [R, t, Hq, D] a tile of t queries per request (q_valid [R, t]: the real ones); landmarks,
    chunk_slots [R, N], selectable, scale as `landmark_logits_reference` -> [R, Hkv, N] float32:
    per KV head, each chunk's softmax probability (over the request's chunks, max over the KV
    group's query heads) summed over the tile's valid queries; -1 where not selectable."""
    r, t, hq, d = q.shape
    h = landmarks.shape[1]
    g, n = hq // h, chunk_slots.shape[1]
    slots = chunk_slots.long()
    lm = landmarks[slots].float()  # [R, N, Hkv, D]
    if scale is not None:
        lm = lm * scale[slots][..., None]
    queries = q.float().view(r, t, h, g, d).permute(0, 2, 1, 3, 4).reshape(r, h, t * g, d)
    logits = queries @ lm.permute(0, 2, 3, 1) * sm_scale  # [R, Hkv, t * G, N]
    blocked = ~selectable[slots].permute(0, 2, 1).bool()[:, :, None, :]  # [R, Hkv, 1, N]
    probs = logits.masked_fill(blocked, float("-inf")).softmax(-1).view(r, h, t, g, n).amax(3)
    return (probs * q_valid[:, None, :, None]).nan_to_num().sum(2).masked_fill(blocked[:, :, 0], -1.0)


@triton.jit
def _tile_logits(Q, L, SLOTS, SEL, SCALE, sm_scale, N, T, r, h, rb, nb,
                 stride_qr, stride_qt, stride_qh, stride_ls, stride_lh, stride_sr, stride_sel, stride_scale,
                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, QUERY_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
                 DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr):
    """Logits [QUERY_BLOCK·GROUP_PAD, BLOCK_N] of query block rb of request r (rows: query-major,
    then the KV group's heads) against chunk block nb, KV head h; -inf where a row is padding or a
    chunk not selectable. Also returns which chunks are selectable [BLOCK_N]."""
    ROWS: tl.constexpr = QUERY_BLOCK * GROUP_PAD
    offs_m = tl.arange(0, ROWS)
    offs_d, d_ok = head_dims(HEAD_DIM, DIM_PAD)
    query = rb * QUERY_BLOCK + offs_m // GROUP_PAD
    head = h * GROUP + offs_m % GROUP_PAD
    m_valid = (offs_m % GROUP_PAD < GROUP) & (query < T)
    q = tl.load(Q + r * stride_qr + query[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_ok[None, :], other=0.0)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = offs_n < N
    slot = tl.load(SLOTS + r * stride_sr + offs_n, mask=n_valid, other=0).to(tl.int64)
    lm = tl.load(L + slot[None, :] * stride_ls + h * stride_lh + offs_d[:, None], mask=n_valid[None, :] & d_ok[:, None],
                 other=0.0)
    s = tl.dot(q, lm.to(q.dtype)).to(tl.float32) * sm_scale  # int8 values are exact in q's dtype
    if SCALED:
        s *= tl.load(SCALE + slot * stride_scale + h, mask=n_valid, other=0.0)[None, :]
    allowed = (tl.load(SEL + slot * stride_sel + h, mask=n_valid, other=0) != 0) & n_valid
    return tl.where(m_valid[:, None] & allowed[None, :], s, float("-inf")), allowed


@triton.jit
def _tile_row_stats_kernel(Q, L, SLOTS, SEL, SCALE, ROW_MAX, ROW_SUM, sm_scale, N, T, NUM_HEADS,
                           stride_qr, stride_qt, stride_qh, stride_ls, stride_lh, stride_sr, stride_sel, stride_scale,
                           GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, QUERY_BLOCK: tl.constexpr,
                           HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr):
    """Pass 1: each row's max and sum of exp over one chunk block (the softmax's partial statistics)."""
    rh, rb, nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s, _ = _tile_logits(Q, L, SLOTS, SEL, SCALE, sm_scale, N, T, rh // NUM_HEADS, rh % NUM_HEADS, rb, nb,
                        stride_qr, stride_qt, stride_qh, stride_ls, stride_lh, stride_sr, stride_sel, stride_scale,
                        GROUP, GROUP_PAD, QUERY_BLOCK, HEAD_DIM, DIM_PAD, BLOCK_N, SCALED)
    ROWS: tl.constexpr = QUERY_BLOCK * GROUP_PAD
    m = tl.max(s, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(s - m_safe[:, None]), 1)
    at = (rh * tl.num_programs(2) + nb) * tl.num_programs(1) * ROWS + rb * ROWS + tl.arange(0, ROWS)
    tl.store(ROW_MAX + at, m)
    tl.store(ROW_SUM + at, total)


@triton.jit
def _tile_mass_kernel(Q, L, SLOTS, SEL, SCALE, LSE, Q_VALID, MASS, sm_scale, N, T, NUM_HEADS,
                      stride_qr, stride_qt, stride_qh, stride_ls, stride_lh, stride_sr, stride_sel, stride_scale,
                      stride_vr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, QUERY_BLOCK: tl.constexpr,
                      HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr):
    """Pass 2: probabilities from the rows' log-sum-exp, max over each query's heads, summed over
    the block's valid queries: one query block's share of a chunk block's mass (-1 on the first
    block's share where a chunk is not selectable, 0 on the others'; the shares are summed after)."""
    rh, rb, nb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = rh // NUM_HEADS
    s, allowed = _tile_logits(Q, L, SLOTS, SEL, SCALE, sm_scale, N, T, r, rh % NUM_HEADS, rb, nb,
                              stride_qr, stride_qt, stride_qh, stride_ls, stride_lh, stride_sr, stride_sel,
                              stride_scale, GROUP, GROUP_PAD, QUERY_BLOCK, HEAD_DIM, DIM_PAD, BLOCK_N, SCALED)
    ROWS: tl.constexpr = QUERY_BLOCK * GROUP_PAD
    lse = tl.load(LSE + (rh * tl.num_programs(1) + rb) * ROWS + tl.arange(0, ROWS))
    p = tl.exp(s - tl.where(lse == float("-inf"), 0.0, lse)[:, None])  # 0 where s is -inf
    per_query = tl.max(tl.reshape(p, (QUERY_BLOCK, GROUP_PAD, BLOCK_N)), 1)  # [QUERY_BLOCK, BLOCK_N]
    offs_t = rb * QUERY_BLOCK + tl.arange(0, QUERY_BLOCK)
    valid = tl.load(Q_VALID + r * stride_vr + offs_t, mask=offs_t < T, other=0.0)
    mass = tl.sum(per_query * valid[:, None], 0)
    mass = tl.where(allowed, mass, tl.where(rb == 0, -1.0, 0.0))
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(MASS + (rh * tl.num_programs(1) + rb) * N + offs_n, mass, mask=offs_n < N)


def tile_landmark_mass(q, q_valid, landmarks, chunk_slots, selectable, sm_scale, scale=None, block_n: int = 128):
    """Triton version of `tile_landmark_mass_reference` (same arguments): two passes over the
    landmarks (the rows' softmax statistics, then the mass), never holding the [R, Hkv, t·G, N]
    probabilities the reference builds (at 128K, 16K columns per row)."""
    r, t, hq, d = q.shape
    h, n = landmarks.shape[1], chunk_slots.shape[1]
    group = hq // h
    if r == 0 or n == 0:
        return torch.full((r, h, n), -1.0, device=q.device)
    if scale is not None and scale.stride(1) != 1:
        raise ValueError("scale must be contiguous over KV heads")
    query_block, group_pad = program_rows(t, group, SCORE_QUERY_BLOCK)
    q_blocks, n_blocks, rows = triton.cdiv(t, query_block), triton.cdiv(n, block_n), query_block * group_pad
    common = (q, landmarks, chunk_slots, selectable, selectable if scale is None else scale)  # (SCALE unread if unscaled)
    strides = (q.stride(0), q.stride(1), q.stride(2), landmarks.stride(0), landmarks.stride(1), chunk_slots.stride(0),
               selectable.stride(0), 0 if scale is None else scale.stride(0))
    meta = dict(GROUP=group, GROUP_PAD=group_pad, QUERY_BLOCK=query_block, HEAD_DIM=d, DIM_PAD=dim_pad(d), BLOCK_N=block_n,
                SCALED=scale is not None)
    grid = (r * h, q_blocks, n_blocks)
    row_max = torch.empty(r * h, n_blocks, q_blocks * rows, device=q.device)
    row_sum = torch.empty_like(row_max)
    _tile_row_stats_kernel[grid](*common, row_max, row_sum, sm_scale, n, t, h, *strides, **meta)
    lse = (row_max + row_sum.log()).logsumexp(1).contiguous()  # [R·Hkv, q_blocks·rows]; -inf: nothing
    shares = torch.empty(r * h, q_blocks, n, device=q.device)
    valid = q_valid.float().contiguous()
    _tile_mass_kernel[grid](*common, lse, valid, shares, sm_scale, n, t, h, *strides, valid.stride(0), **meta)
    return shares.sum(1).view(r, h, n)
