"""Exact decode attention over ShadowKV's three sources: outlier chunks, selected chunks, dense window.

Per request b and KV head h, the keys are:
  outliers  blocks_k[outlier_blocks[b, h, i]]                                   (-1 = none)
  selected  blocks_k[scratch_pages[scratch_rows[b], entries[b, h, j]]·Hkv + h]  (-1 entry = none)
  window    k_pool[window_indices[window_indptr[b]:window_indptr[b+1]], h]  (dense recent tokens)
and the values are laid out the same way in blocks_v. blocks_k / blocks_v are the dense pool's K
and V memory as [c, D] blocks (kernels/scratch_blocks.py): outlier chunks and the chunk-cache
scratch (rebuilt/fetched chunks, a row of pages per request) are read alike. One softmax spans all
three; each query head reads its KV head (GQA). One program per (request, KV head) serves all its
query heads. With `lse` the log-sum-exp of each query head's scores is stored too (natural log;
-inf and a zero output when nothing is attended), so partial attentions over disjoint key sets can
be merged: a suffix prefill attends the compressed prefix this way, one query per "request", and
its own tokens densely.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_shadowkv.kernels.scratch_blocks import scratch_block, scratch_blocks


def sparse_decode_attention_reference(q, blocks_k, blocks_v, outlier_blocks, scratch_pages, scratch_rows, entries,
                                      k_pool, v_pool, window_indptr, window_indices, sm_scale, lse=None):
    """q [B, Hq, D] -> [B, Hq, D]; float32 softmax over the gathered keys of each KV head;
    lse [B, Hq] float32, if given, receives each query head's log-sum-exp.

    The keys of every (request, KV head) are gathered into one padded tensor with a mask
    (missing outliers, entries and window positions masked out), so a step is a few batched
    operations: this is also ShadowKV's decode attention on a CPU."""
    b_, hq, d = q.shape
    hkv = k_pool.shape[1]
    blocks = torch.cat([outlier_blocks.long(), scratch_blocks(scratch_pages, scratch_rows, entries)], 2)
    b_ok, b_ids = blocks >= 0, blocks.clamp(min=0)  # [B, Hkv, O + K]
    lens = window_indptr[1:] - window_indptr[:-1]
    width = int(lens.max()) if b_ > 0 else 0
    w_pos = torch.arange(width, device=q.device)
    w_ok = w_pos[None, :] < lens[:, None]  # [B, W]
    w_ids = window_indices[(window_indptr[:-1, None] + w_pos).clamp(max=max(window_indices.numel() - 1, 0))
                           * w_ok].long()  # [B, W]; masked positions read a valid slot

    def keys(memory, pool):  # [B, Hkv, L, D]: outliers and selected chunks, then the window
        return torch.cat([memory[b_ids].flatten(2, 3), pool[w_ids].transpose(1, 2)], dim=2).float()

    c = blocks_k.shape[1]
    valid = torch.cat([b_ok.repeat_interleave(c, dim=2), w_ok[:, None, :].expand(-1, hkv, -1)], dim=2)  # [B, Hkv, L]
    qh = q.float().view(b_, hkv, hq // hkv, d)
    scores = (qh @ keys(blocks_k, k_pool).transpose(2, 3) * sm_scale).masked_fill(~valid[:, :, None], float("-inf"))
    total = scores.logsumexp(-1)  # [B, Hkv, G]; -inf where nothing is attended
    probs = torch.exp(scores - total.nan_to_num(neginf=0.0)[..., None])
    values = keys(blocks_v, v_pool).masked_fill(~valid[..., None], 0.0)  # masked: may be garbage
    out = (probs @ values).view(b_, hq, d)
    if lse is not None:
        lse.copy_(total.view(b_, hq))
    return out.to(q.dtype)


@triton.jit
def _online_softmax_step(q, k, v, valid, m_i, l_i, acc, sm_scale):
    """Fold one block of keys k [D, N] and values v [N, D] into the running softmax state."""
    s = tl.dot(q, k.to(q.dtype)).to(tl.float32) * sm_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with no valid key yet
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32))
    return m_new, l_i, acc


@triton.jit
def _fold_chunks(q, BLOCKS_K, BLOCKS_V, block, valid, token_of, m_i, l_i, acc, sm_scale, stride_block,
                 HEAD_DIM: tl.constexpr):
    """Fold keys from [c, D] blocks: key n is token token_of[n] of block block[n] (masked where not valid)."""
    offs_d = tl.arange(0, HEAD_DIM)
    base = block * stride_block + token_of * HEAD_DIM
    k = tl.load(BLOCKS_K + base[None, :] + offs_d[:, None], mask=valid[None, :], other=0.0)
    v = tl.load(BLOCKS_V + base[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    return _online_softmax_step(q, k, v, valid, m_i, l_i, acc, sm_scale)


@triton.jit
def _sparse_decode_kernel(Q, BLOCKS_K, BLOCKS_V, OUTLIERS, SCRATCH_PAGES, ROWS, ENTRIES, K_POOL, V_POOL,
                          W_INDPTR, W_INDICES, O_OUT, LSE, sm_scale, NUM_OUT, NUM_ENT,
                          stride_qb, stride_qh, stride_block, stride_olb, stride_olh, stride_sp,
                          stride_eb, stride_eh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ob, stride_oh,
                          GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                          CHUNK: tl.constexpr, CHUNKS_PER_BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
                          STORE_LSE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    g_valid = offs_g < GROUP
    q = tl.load(Q + b * stride_qb + (h * GROUP + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=g_valid[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    BLOCK: tl.constexpr = CHUNKS_PER_BLOCK * CHUNK
    offs_n = tl.arange(0, BLOCK)
    chunk_of = offs_n // CHUNK
    token_of = offs_n % CHUNK
    # outlier chunks: blocks named by the plan
    for i in range(0, NUM_OUT, CHUNKS_PER_BLOCK):
        idx = i + chunk_of
        block = tl.load(OUTLIERS + b * stride_olb + h * stride_olh + idx, mask=idx < NUM_OUT, other=-1).to(tl.int64)
        m_i, l_i, acc = _fold_chunks(q, BLOCKS_K, BLOCKS_V, block, block >= 0, token_of, m_i, l_i, acc, sm_scale,
                                     stride_block, HEAD_DIM)
    # selected chunks: entries of this request's scratch row, blocks of its pages
    row = tl.load(ROWS + b).to(tl.int64)
    for j in range(0, NUM_ENT, CHUNKS_PER_BLOCK):
        idx = j + chunk_of
        entry = tl.load(ENTRIES + b * stride_eb + h * stride_eh + idx, mask=idx < NUM_ENT, other=-1)
        valid = entry >= 0
        block = scratch_block(SCRATCH_PAGES, stride_sp, row, tl.maximum(entry, 0), h, num_heads)
        m_i, l_i, acc = _fold_chunks(q, BLOCKS_K, BLOCKS_V, block, valid, token_of, m_i, l_i, acc, sm_scale,
                                     stride_block, HEAD_DIM)
    # dense window: token slots of the paged pool
    w_start = tl.load(W_INDPTR + b)
    w_len = tl.load(W_INDPTR + b + 1) - w_start
    offs_w = tl.arange(0, BLOCK_W)
    for n in range(0, w_len, BLOCK_W):
        valid = n + offs_w < w_len
        slot = tl.load(W_INDICES + w_start + n + offs_w, mask=valid, other=0).to(tl.int64)
        k = tl.load(K_POOL + slot[None, :] * stride_kt + h * stride_kh + offs_d[:, None],
                    mask=valid[None, :], other=0.0)
        v = tl.load(V_POOL + slot[:, None] * stride_vt + h * stride_vh + offs_d[None, :],
                    mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _online_softmax_step(q, k, v, valid, m_i, l_i, acc, sm_scale)
    empty = l_i == 0.0  # nothing attended: a zero output, and -inf for merging
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(O_OUT + b * stride_ob + (h * GROUP + offs_g)[:, None] * stride_oh + offs_d[None, :],
             out.to(O_OUT.dtype.element_ty), mask=g_valid[:, None])
    if STORE_LSE:
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        tl.store(LSE + b * GROUP * num_heads + h * GROUP + offs_g, lse, mask=g_valid)


def sparse_decode_attention(q, blocks_k, blocks_v, outlier_blocks, scratch_pages, scratch_rows, entries,
                            k_pool, v_pool, window_indptr, window_indices, sm_scale, lse=None):
    """Triton version of `sparse_decode_attention_reference` (same arguments)."""
    b, hq, d = q.shape
    hkv = k_pool.shape[1]
    chunk = blocks_k.shape[1]
    out = torch.empty_like(q)
    if b == 0:
        return out
    if blocks_k.stride() != blocks_v.stride() or blocks_k.stride(1) != d or blocks_k.stride(2) != 1:
        raise ValueError("blocks_k and blocks_v must be contiguous [c, D] blocks, laid out alike")
    if scratch_pages.stride(1) != 1:
        raise ValueError("scratch_pages must be contiguous in its last dimension")
    if lse is not None and (lse.shape != (b, hq) or not lse.is_contiguous() or lse.dtype != torch.float32):
        raise ValueError(f"lse must be a contiguous float32 [{b}, {hq}] tensor")
    group = hq // hkv
    _sparse_decode_kernel[(b, hkv)](
        q, blocks_k, blocks_v, outlier_blocks, scratch_pages, scratch_rows, entries, k_pool, v_pool,
        window_indptr, window_indices, out, out if lse is None else lse, sm_scale,  # (LSE unread without lse)
        outlier_blocks.shape[2], entries.shape[2],
        q.stride(0), q.stride(1), blocks_k.stride(0), outlier_blocks.stride(0), outlier_blocks.stride(1),
        scratch_pages.stride(0), entries.stride(0), entries.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d, CHUNK=chunk,
        CHUNKS_PER_BLOCK=max(1, 64 // chunk), BLOCK_W=32, STORE_LSE=lse is not None)
    return out
