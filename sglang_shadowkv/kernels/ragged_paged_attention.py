"""Causal attention of a ragged batch of queries over a token-slot KV pool.

Request i owns queries q[q_indptr[i]:q_indptr[i+1]] and keys/values at slots
kv_indices[kv_indptr[i]:kv_indptr[i+1]]; its queries are the last q_len of its kv_len tokens, so
query j sees keys 0 .. kv_len - q_len + j. One kernel covers a prefill chunk over a cached prefix,
a decode step (q_len = 1) and a mix of both. GQA: query head h reads KV head h // (Hq // Hkv).
With `lse` [T, Hq] float32 the log-sum-exp of each query head's scores is stored too, so that a
partial attention (a suffix over its own tokens) can be merged with another over other keys.

A decode-only batch takes its own kernel: one program per request and KV head serves all of that
head's query heads (each key read once, not once per query head), and each request's keys are
split among several programs (key_splits.py), so that a few long rows still keep every SM
reading. Walking 32K keys in one program per query head made an 8B-shape decode step take about
52 ms on an H200 whatever its rows or tensor-parallel size (benchmarks/results/tp_8b_h200x2.json).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sglang_shadowkv.kernels.head_dims import dim_pad, head_dims
from sglang_shadowkv.kernels.key_splits import MAX_SPLITS, decode_key_splits, merge_splits


def ragged_paged_attention_reference(q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, sm_scale,
                                     hidden=None, lse=None):
    """Plain torch (SDPA in float32): gather each request's keys and values, causal softmax.

    hidden: optional [num_slots, Hkv] bool, True where a KV head may not see a slot's key (the
    eviction baselines); a request's own new tokens must not be hidden.
    """
    out = torch.empty_like(q)
    q_ptr, kv_ptr = q_indptr.tolist(), kv_indptr.tolist()
    for i in range(len(q_ptr) - 1):
        qs, qe, ks, ke = q_ptr[i], q_ptr[i + 1], kv_ptr[i], kv_ptr[i + 1]
        if qe == qs:
            continue
        slots = kv_indices[ks:ke].long()
        out[qs:qe] = causal_attention(q[qs:qe], k_pool[slots], v_pool[slots], sm_scale,
                                      None if hidden is None else hidden[slots])
        if lse is not None:
            lse[qs:qe] = causal_logsumexp(q[qs:qe], k_pool[slots], sm_scale)
    return out


def causal_logsumexp(q, k, sm_scale):
    """[q_len, Hq] log-sum-exp of each query head's causal scores (q the last q_len of k's tokens)."""
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(group, dim=1)) * sm_scale
    scores = scores.masked_fill(~causal_mask(q.shape[0], k.shape[0], q.device)[None], float("-inf"))
    return scores.logsumexp(-1).T


def causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """[q_len, kv_len] bool: the last q_len of kv_len tokens see themselves and every earlier key."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)
    return torch.arange(kv_len, device=device)[None, :] <= q_pos[:, None]


def causal_attention(q, k, v, sm_scale, hidden=None):
    """q [q_len, Hq, D] are the last q_len of the kv_len tokens of k/v [kv_len, Hkv, D]; query j
    sees keys 0 .. kv_len - q_len + j, less those `hidden` [kv_len, Hkv] hides from its KV head."""
    q_len, kv_len, num_heads = q.shape[0], k.shape[0], q.shape[1]
    group = num_heads // k.shape[1]
    mask = None
    if hidden is not None and bool(hidden.any()):
        causal = causal_mask(q_len, kv_len, q.device)
        mask = (causal[None] & ~hidden.T[:, None, :]).repeat_interleave(group, dim=0)[None]
    elif q_len != kv_len:
        mask = causal_mask(q_len, kv_len, q.device)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
        attn_mask=mask, is_causal=mask is None and q_len > 1, scale=sm_scale, enable_gqa=group > 1)
    return out[0].transpose(0, 1).to(q.dtype)


@triton.jit
def _attend_block(q, K, V, slot, n_valid, visible, kv_head, m_i, l_i, acc, sm_scale,
                  stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok):
    """One block of keys (pool slots `slot`, `n_valid` of them real) folded into the running
    softmax (m_i, l_i, acc) of q's rows; `visible` [rows, keys] is what each row may see."""
    k = tl.load(K + slot[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                mask=n_valid[None, :] & d_ok[:, None], other=0.0)
    s = tl.dot(q, k).to(tl.float32) * sm_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                mask=n_valid[:, None] & d_ok[None, :], other=0.0)
    # p stays float32 (a tf32 product on GPU): rounding it to bf16 costs ~1e-2 of logit accuracy
    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
    return m_new, l_i, acc


@triton.jit
def _ragged_attention_kernel(
    Q, K, V, O, LSE, q_indptr, kv_indptr, kv_indices, sm_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, STORE_LSE: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    q_start = tl.load(q_indptr + req)
    q_len = tl.load(q_indptr + req + 1) - q_start
    if m_block * BLOCK_M < q_len:
        kv_start = tl.load(kv_indptr + req)
        kv_len = tl.load(kv_indptr + req + 1) - kv_start
        prefix = kv_len - q_len
        kv_head = head // GROUP
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d, d_ok = head_dims(HEAD_DIM, DIM_PAD)
        m_valid = offs_m < q_len
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=m_valid[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
        kv_end = tl.minimum(kv_len, prefix + (m_block + 1) * BLOCK_M)
        for n in range(0, kv_end, BLOCK_N):
            offs_n = n + tl.arange(0, BLOCK_N)
            n_valid = offs_n < kv_len
            slot = tl.load(kv_indices + kv_start + offs_n, mask=n_valid, other=0).to(tl.int64)
            visible = (offs_n[None, :] <= prefix + offs_m[:, None]) & n_valid[None, :]
            m_i, l_i, acc = _attend_block(q, K, V, slot, n_valid, visible, kv_head, m_i, l_i, acc, sm_scale,
                                          stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok)
        out = acc / l_i[:, None]
        tl.store(O + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(O.dtype.element_ty), mask=m_valid[:, None] & d_ok[None, :])
        if STORE_LSE:
            tl.store(LSE + (q_start + offs_m) * stride_lt + head, m_i + tl.log(l_i), mask=m_valid)


def ragged_paged_attention(q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, sm_scale,
                           max_q_len: int | None = None, lse=None, splits: int | None = None):
    """Triton version of `ragged_paged_attention_reference` (same arguments). With max_q_len 1
    (a decode-only batch), `splits` (default: `decode_key_splits`) divides each request's keys
    among that many programs."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    batch = q_indptr.numel() - 1
    if max_q_len is None:
        max_q_len = int((q_indptr[1:] - q_indptr[:-1]).max()) if batch else 0
    if batch == 0 or max_q_len == 0:
        return out
    if lse is not None and (lse.shape != (num_tokens, num_heads) or lse.stride(1) != 1 or lse.dtype != torch.float32):
        raise ValueError(f"lse must be a float32 [{num_tokens}, {num_heads}] tensor, contiguous over heads")
    if max_q_len == 1:
        return _decode_attention(q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, sm_scale, out, lse, splits)
    block_m = 16 if max_q_len <= 16 else 64
    block_n = 64 if dim_pad(head_dim) <= 64 else 32
    grid = (batch, num_heads, triton.cdiv(max_q_len, block_m))
    _ragged_attention_kernel[grid](
        q, k_pool, v_pool, out, out if lse is None else lse, q_indptr, kv_indptr, kv_indices, sm_scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1), 0 if lse is None else lse.stride(0),
        GROUP=num_heads // k_pool.shape[1], HEAD_DIM=head_dim, DIM_PAD=dim_pad(head_dim), BLOCK_M=block_m,
        BLOCK_N=block_n,
        STORE_LSE=lse is not None,
    )
    return out


DECODE_KEYS_PER_BLOCK = 64


def _decode_attention(q, k_pool, v_pool, q_indptr, kv_indptr, kv_indices, sm_scale, out, lse, splits):
    """Each request's one query token over its keys, split `splits` ways, merged."""
    num_tokens, num_heads, head_dim = q.shape
    batch, kv_heads = q_indptr.numel() - 1, k_pool.shape[1]
    if splits is None:
        splits = decode_key_splits(batch, kv_heads, q.device)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    if splits > 1:  # partial outputs and log-sum-exps per split, merged below
        dest = torch.empty(splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        dest_lse = torch.empty(splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
        strides = (dest.stride(1), dest.stride(2), dest.stride(0), dest_lse.stride(1), dest_lse.stride(0))
    else:
        dest, dest_lse = out, out if lse is None else lse  # (LSE unwritten without lse)
        strides = (out.stride(0), out.stride(1), 0, 0 if lse is None else lse.stride(0), 0)
    group = num_heads // kv_heads
    _decode_kernel[(batch, kv_heads, splits)](
        q, k_pool, v_pool, dest, dest_lse, q_indptr, kv_indptr, kv_indices, sm_scale,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), *strides,
        splits, lse is not None or splits > 1, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, DIM_PAD=dim_pad(head_dim), BLOCK_N=DECODE_KEYS_PER_BLOCK)
    if splits > 1:
        merge_splits(dest, dest_lse, out, lse)
    return out


@triton.jit(do_not_specialize=["SPLITS", "STORE_LSE"])
def _decode_kernel(
    Q, K, V, O, LSE, q_indptr, kv_indptr, kv_indices, sm_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_os,
    stride_lt, stride_ls, SPLITS, STORE_LSE,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One (request, KV head, split): the GROUP query heads of the request's token over the
    split's share of its keys (whole blocks); its output and log-sum-exp go to split `split`'s
    place (O and LSE themselves without splits). A split with no keys stores 0 and -inf."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(q_indptr + req)
    kv_start = tl.load(kv_indptr + req)
    kv_len = tl.load(kv_indptr + req + 1) - kv_start
    per = tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = tl.minimum(split * per, kv_len)
    hi = tl.minimum(lo + per, kv_len)
    offs_g = tl.arange(0, GROUP_PAD)
    g_ok = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d, d_ok = head_dims(HEAD_DIM, DIM_PAD)
    q = tl.load(Q + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for n in range(lo, hi, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < hi
        slot = tl.load(kv_indices + kv_start + offs_n, mask=n_valid, other=0).to(tl.int64)
        m_i, l_i, acc = _attend_block(q, K, V, slot, n_valid, n_valid[None, :], kv_head, m_i, l_i, acc, sm_scale,
                                      stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_ok)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(O + split * stride_os + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    if STORE_LSE:
        tl.store(LSE + split * stride_ls + token * stride_lt + heads,
                 tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i))), mask=g_ok)
