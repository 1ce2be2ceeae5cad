"""Raw landmark logits of one decode query per request: q · landmark for every chunk of the request.

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


def landmark_logits_reference(q, landmarks, chunk_slots, selectable, sm_scale, scale=None):
    """q [B, Hq, D]; landmarks [S, Hkv, D]; chunk_slots [B, N] int; selectable [S, Hkv] int8;
    scale [S, Hkv] (int8 landmarks) -> [B, Hq, N] float32 logits, -inf where the chunk is not
    selectable for that KV head."""
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
def _landmark_logits_kernel(Q, L, SLOTS, SEL, SCALE, OUT, sm_scale, N,
                            stride_qb, stride_qh, stride_ls, stride_lh, stride_sb,
                            stride_sel, stride_scale, stride_ob, stride_oh,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_N: tl.constexpr, SCALED: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    nb = tl.program_id(2)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    g_valid = offs_g < GROUP
    n_valid = offs_n < N
    q = tl.load(Q + b * stride_qb + (h * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=g_valid[:, None], other=0.0)
    slot = tl.load(SLOTS + b * stride_sb + offs_n, mask=n_valid, other=0).to(tl.int64)
    lm = tl.load(L + slot[None, :] * stride_ls + h * stride_lh + offs_d[:, None],
                 mask=n_valid[None, :], other=0.0)
    s = tl.dot(q, lm.to(q.dtype)).to(tl.float32) * sm_scale  # int8 values are exact in q's dtype
    if SCALED:
        s *= tl.load(SCALE + slot * stride_scale + h, mask=n_valid, other=0.0)[None, :]
    sel = tl.load(SEL + slot * stride_sel + h, mask=n_valid, other=0)
    s = tl.where(sel[None, :] != 0, s, float("-inf"))
    tl.store(OUT + b * stride_ob + (h * GROUP + offs_g)[:, None] * stride_oh + offs_n[None, :], s,
             mask=g_valid[:, None] & n_valid[None, :])


def landmark_logits(q, landmarks, chunk_slots, selectable, sm_scale, scale=None, block_n: int = 64):
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
        selectable if scale is None else scale, out, sm_scale, n,  # (SCALE unread if unscaled)
        q.stride(0), q.stride(1), landmarks.stride(0), landmarks.stride(1), chunk_slots.stride(0),
        selectable.stride(0), 0 if scale is None else scale.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, BLOCK_N=block_n,
        SCALED=scale is not None)
    return out
