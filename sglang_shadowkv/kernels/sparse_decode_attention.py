"""Exact decode attention over ShadowKV's three sources: outlier chunks, selected chunks, dense window.

Per request b and KV head h, the keys are:
  outliers  blocks_k[outlier_blocks[b, h, i]]                                   (-1 = none)
  selected  blocks_k[scratch_pages[scratch_rows[b], entries[b, h, j]]·Hkv + h]  (-1 entry = none)
  window    k_pool[window_indices[window_indptr[b]:window_indptr[b+1]], h]  (dense recent tokens)
and the values are laid out the same way in blocks_v. blocks_k / blocks_v are the dense pool's K
and V memory as [c, D] blocks (kernels/scratch_blocks.py): outlier chunks and the chunk-cache
scratch (rebuilt/fetched chunks, a row of pages per request) are read alike. `outlier_memory`
(K, V blocks laid out alike) names other memory for the outliers: a suffix's every-chunk round
reads its chunks from a workspace of its own and its outliers from the pool, in one pass. One softmax spans all
three; each query head reads its KV head (GQA). One program per (request, KV head) serves all its
query heads. With `lse` the log-sum-exp of each query head's scores is stored too (natural log;
-inf and a zero output when nothing is attended), so partial attentions over disjoint key sets can
be merged: a suffix prefill attends the compressed prefix this way and its own tokens densely.
There a "request" is a tile of `queries_per_request` queries (rows b·Q .. b·Q + Q - 1 of q) that
share one selection: a program serves QUERY_BLOCK of them, so the tile's keys are read once per
QUERY_BLOCK queries instead of once per query (64 queries per tile read them 64 times before).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sglang_shadowkv.kernels.head_dims import dim_pad, head_dims
from sglang_shadowkv.kernels.key_splits import MAX_SPLITS, key_splits, merge_splits
from sglang_shadowkv.kernels.padding_rows import live_row, live_rows
from sglang_shadowkv.kernels.scratch_blocks import scratch_block, scratch_blocks

# queries of a tile per program: 32 queries x 4 heads = 128 rows of a dot, on 8 warps. On the H100
# (bench_kernels key_splits shapes) 16 queries on 4 warps took 680 µs a layer for 16 tiles of 64
# queries against 511 (one tile: 65 against 52 µs); decode programs (16 rows) keep 4 warps
TILE_QUERY_BLOCK = 32
WIDE_PROGRAM_ROWS = 128  # a program with this many dot rows (a suffix's tile) runs on 8 warps


@dataclass(frozen=True)
class Launch:
    """How a program walks its keys: keys folded per step, warps, pipeline stages (None: Triton's
    default) and the least key splits (more when programs alone leave SMs idle, `key_splits`)."""
    keys_per_block: int
    warps: int
    stages: int | None
    least_splits: int


# decode programs (rows below WIDE_PROGRAM_ROWS): on the H100, 16 requests x 304 chunks of 8 tokens
# (maintainers/experiments/tune_decode_kernels.py) took 69-71 µs a layer this way against 103 µs for 64 keys, 3
# stages and no split (48 requests: 185 against 245 µs). Suffix tiles keep the settings measured
# with them (bench_kernels key_splits: splits there lost 18% for 4 tiles).
DECODE_LAUNCH = Launch(keys_per_block=128, warps=4, stages=2, least_splits=2)
TILE_LAUNCH = Launch(keys_per_block=64, warps=8, stages=None, least_splits=1)


def launch_for(query_block: int, group_pad: int) -> Launch:
    return TILE_LAUNCH if query_block * group_pad >= WIDE_PROGRAM_ROWS else DECODE_LAUNCH


def program_rows(queries: int, group: int, max_query_block: int = TILE_QUERY_BLOCK) -> tuple[int, int]:
    """(queries, heads) a program's dot rows cover: up to max_query_block of a request's queries
    times its KV group's query heads, the heads padded to a power of two and so that the dot has
    at least 16 rows (tl.dot's least: one decode query pads its heads to 16)."""
    query_block = min(max_query_block, triton.next_power_of_2(queries))
    return query_block, max(triton.next_power_of_2(group), triton.cdiv(16, query_block))


def chunks_per_key_block(chunk: int, launch: Launch) -> int:
    """Chunks a program folds per step: the launch's keys per block."""
    return max(1, launch.keys_per_block // chunk)


def sparse_decode_attention_reference(q, blocks_k, blocks_v, outlier_blocks, scratch_pages, scratch_rows, entries,
                                      k_pool, v_pool, window_indptr, window_indices, sm_scale, lse=None,
                                      queries_per_request=1, out_dtype=None, live=None, outlier_memory=None):
    """q [B·Q, Hq, D] -> [B·Q, Hq, D] of out_dtype (default q's; Q = queries_per_request: rows b·Q..
    of q attend request b's keys); float32 softmax over the gathered keys of each KV head; lse
    [B·Q, Hq] float32, if given, receives each query head's log-sum-exp. Requests from live on
    (padding_rows) attend nothing: a zero output, lse -inf.

    The keys of every (request, KV head) are gathered into one padded tensor with a mask
    (missing outliers, entries and window positions masked out), so a step is a few batched
    operations: this is also ShadowKV's decode attention on a CPU."""
    hq, d = q.shape[1:]
    nq = queries_per_request
    b_ = q.shape[0] // nq
    hkv = k_pool.shape[1]
    out_k, out_v = outlier_memory or (blocks_k, blocks_v)
    outliers, selected = outlier_blocks.long(), scratch_blocks(scratch_pages, scratch_rows, entries)
    b_ok = torch.cat([outliers, selected], 2) >= 0  # [B, Hkv, O + K]
    outlier_ids, selected_ids = outliers.clamp(min=0), selected.clamp(min=0)
    lens = window_indptr[1:] - window_indptr[:-1]
    width = int(lens.max()) if b_ > 0 else 0
    w_pos = torch.arange(width, device=q.device)
    w_ok = w_pos[None, :] < lens[:, None]  # [B, W]
    w_ids = window_indices[(window_indptr[:-1, None] + w_pos).clamp(max=max(window_indices.numel() - 1, 0))
                           * w_ok].long()  # [B, W]; masked positions read a valid slot

    def keys(outlier_mem, memory, pool):  # [B, Hkv, L, D]: outliers and selected chunks, then the window
        return torch.cat([outlier_mem[outlier_ids].flatten(2, 3), memory[selected_ids].flatten(2, 3),
                          pool[w_ids].transpose(1, 2)], dim=2).float()

    c = blocks_k.shape[1]
    valid = torch.cat([b_ok.repeat_interleave(c, dim=2), w_ok[:, None, :].expand(-1, hkv, -1)], dim=2)  # [B, Hkv, L]
    valid &= (torch.arange(b_, device=q.device) < live_rows(live, b_))[:, None, None]
    g = hq // hkv
    qh = q.float().view(b_, nq, hkv, g, d).transpose(1, 2).reshape(b_, hkv, nq * g, d)
    scores = (qh @ keys(out_k, blocks_k, k_pool).transpose(2, 3) * sm_scale).masked_fill(~valid[:, :, None], float("-inf"))
    total = scores.logsumexp(-1)  # [B, Hkv, Q·G]; -inf where nothing is attended
    probs = torch.exp(scores - total.nan_to_num(neginf=0.0)[..., None])
    values = keys(out_v, blocks_v, v_pool).masked_fill(~valid[..., None], 0.0)  # masked: may be garbage
    out = (probs @ values).view(b_, hkv, nq, g, d).transpose(1, 2).reshape(b_ * nq, hq, d)
    if lse is not None:
        lse.copy_(total.view(b_, hkv, nq, g).transpose(1, 2).reshape(b_ * nq, hq))
    return out.to(out_dtype or q.dtype)


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
                 HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    """Fold keys from [c, D] blocks: key n is token token_of[n] of block block[n] (masked where not valid)."""
    offs_d, d_ok = head_dims(HEAD_DIM, DIM_PAD)
    base = block * stride_block + token_of * HEAD_DIM
    k = tl.load(BLOCKS_K + base[None, :] + offs_d[:, None], mask=valid[None, :] & d_ok[:, None], other=0.0)
    v = tl.load(BLOCKS_V + base[:, None] + offs_d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
    return _online_softmax_step(q, k, v, valid, m_i, l_i, acc, sm_scale)


# SPLITS and STORE_LSE are run-time arguments, not specialised: one compiled kernel serves every
# split count, so capturing the decode graphs of all batch sizes compiles it once
@triton.jit(do_not_specialize=["SPLITS", "STORE_LSE"])
def _sparse_decode_kernel(Q, BLOCKS_K, BLOCKS_V, OUT_K, OUT_V, OUTLIERS, SCRATCH_PAGES, ROWS, ENTRIES, K_POOL, V_POOL,
                          W_INDPTR, W_INDICES, O_OUT, LSE, LIVE, sm_scale, NUM_OUT, NUM_ENT, OUT_SPLIT_STRIDE,
                          stride_qb, stride_qh, stride_block, stride_olb, stride_olh, stride_sp,
                          stride_eb, stride_eh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ob, stride_oh,
                          QUERIES, STORE_LSE, SPLITS, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                          QUERY_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                          CHUNK: tl.constexpr, CHUNKS_PER_BLOCK: tl.constexpr, BLOCK_W: tl.constexpr,
                          GATED: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    split = tl.program_id(2) % SPLITS  # this program's share of each key source
    live = live_row(LIVE, b, GATED)  # padding attends none of its keys: the empty output below
    NUM_OUT = tl.where(live, NUM_OUT, 0)
    NUM_ENT = tl.where(live, NUM_ENT, 0)
    # the program's rows: QUERY_BLOCK queries of request b, times its KV head's query heads
    ROWS_M: tl.constexpr = QUERY_BLOCK * GROUP_PAD
    offs_m = tl.arange(0, ROWS_M)
    query = tl.program_id(2) // SPLITS * QUERY_BLOCK + offs_m // GROUP_PAD
    head = h * GROUP + offs_m % GROUP_PAD
    m_valid = (offs_m % GROUP_PAD < GROUP) & (query < QUERIES)
    q_row = (b * QUERIES + query).to(tl.int64)
    offs_d, d_ok = head_dims(HEAD_DIM, DIM_PAD)
    q = tl.load(Q + q_row[:, None] * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([ROWS_M], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS_M], tl.float32)
    acc = tl.zeros([ROWS_M, DIM_PAD], tl.float32)
    BLOCK: tl.constexpr = CHUNKS_PER_BLOCK * CHUNK
    offs_n = tl.arange(0, BLOCK)
    chunk_of = offs_n // CHUNK
    token_of = offs_n % CHUNK
    # outlier chunks: blocks named by the plan
    out_lo, out_hi = _split_range(NUM_OUT, split, SPLITS, CHUNKS_PER_BLOCK)
    for i in range(out_lo, out_hi, CHUNKS_PER_BLOCK):
        idx = i + chunk_of
        block = tl.load(OUTLIERS + b * stride_olb + h * stride_olh + idx, mask=idx < out_hi, other=-1).to(tl.int64)
        m_i, l_i, acc = _fold_chunks(q, OUT_K, OUT_V, block, block >= 0, token_of, m_i, l_i, acc, sm_scale,
                                     stride_block, HEAD_DIM, DIM_PAD)
    # selected chunks: entries of this request's scratch row, blocks of its pages
    row = tl.load(ROWS + b).to(tl.int64)
    ent_lo, ent_hi = _split_range(NUM_ENT, split, SPLITS, CHUNKS_PER_BLOCK)
    for j in range(ent_lo, ent_hi, CHUNKS_PER_BLOCK):
        idx = j + chunk_of
        entry = tl.load(ENTRIES + b * stride_eb + h * stride_eh + idx, mask=idx < ent_hi, other=-1)
        valid = entry >= 0
        block = scratch_block(SCRATCH_PAGES, stride_sp, row, tl.maximum(entry, 0), h, num_heads)
        m_i, l_i, acc = _fold_chunks(q, BLOCKS_K, BLOCKS_V, block, valid, token_of, m_i, l_i, acc, sm_scale,
                                     stride_block, HEAD_DIM, DIM_PAD)
    # dense window: token slots of the paged pool
    w_start = tl.load(W_INDPTR + b)
    w_len = tl.where(live, tl.load(W_INDPTR + b + 1) - w_start, 0)
    offs_w = tl.arange(0, BLOCK_W)
    w_lo, w_hi = _split_range(w_len, split, SPLITS, BLOCK_W)
    for n in range(w_lo, w_hi, BLOCK_W):
        valid = n + offs_w < w_hi
        slot = tl.load(W_INDICES + w_start + n + offs_w, mask=valid, other=0).to(tl.int64)
        k = tl.load(K_POOL + slot[None, :] * stride_kt + h * stride_kh + offs_d[:, None],
                    mask=valid[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(V_POOL + slot[:, None] * stride_vt + h * stride_vh + offs_d[None, :],
                    mask=valid[:, None] & d_ok[None, :], other=0.0)
        m_i, l_i, acc = _online_softmax_step(q, k, v, valid, m_i, l_i, acc, sm_scale)
    empty = l_i == 0.0  # nothing attended: a zero output, and -inf for merging
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    out_at = O_OUT + split * OUT_SPLIT_STRIDE  # with splits: this split's partial output (float32)
    tl.store(out_at + q_row[:, None] * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
             out.to(O_OUT.dtype.element_ty), mask=m_valid[:, None] & d_ok[None, :])
    if STORE_LSE:
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        tl.store(LSE + split * (OUT_SPLIT_STRIDE // HEAD_DIM) + q_row * GROUP * num_heads + head, lse, mask=m_valid)


@triton.jit
def _split_range(count, split, SPLITS, STEP: tl.constexpr):
    """[lo, hi) of split `split` of range(count), in whole steps."""
    per = tl.cdiv(tl.cdiv(count, SPLITS), STEP) * STEP
    lo = tl.minimum(split * per, count)
    return lo, tl.minimum(lo + per, count)


def sparse_decode_attention(q, blocks_k, blocks_v, outlier_blocks, scratch_pages, scratch_rows, entries,
                            k_pool, v_pool, window_indptr, window_indices, sm_scale, lse=None,
                            queries_per_request=1, splits=None, out_dtype=None, live=None, outlier_memory=None):
    """Triton version of `sparse_decode_attention_reference` (same arguments). `splits` (default:
    `key_splits`) divides each program's keys among that many programs, merged by log-sum-exp: a
    few programs alone (a small decode batch, one question's tiles) would leave most of the GPU
    idle while each walks its ~300 chunks one block at a time."""
    n, hq, d = q.shape
    b = n // queries_per_request
    hkv = k_pool.shape[1]
    chunk = blocks_k.shape[1]
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    if b == 0:
        return out
    out_k, out_v = outlier_memory or (blocks_k, blocks_v)
    if any(m.stride() != blocks_k.stride() for m in (blocks_v, out_k, out_v)) or blocks_k.stride(1) != d \
            or blocks_k.stride(2) != 1:
        raise ValueError("blocks_k, blocks_v and the outlier memory must be contiguous [c, D] blocks, laid out alike")
    if scratch_pages.stride(1) != 1 or entries.stride(2) != 1:
        raise ValueError("scratch_pages and entries must be contiguous in their last dimension")
    if lse is not None and (lse.shape != (n, hq) or not lse.is_contiguous() or lse.dtype != torch.float32):
        raise ValueError(f"lse must be a contiguous float32 [{n}, {hq}] tensor")
    if n != b * queries_per_request:
        raise ValueError(f"q's {n} rows are not {queries_per_request} queries per request")
    group = hq // hkv
    query_block, group_pad = program_rows(queries_per_request, group)
    launch = launch_for(query_block, group_pad)
    if splits is None:
        splits = default_key_splits(b, hkv, queries_per_request, outlier_blocks.shape[2], entries.shape[2], chunk,
                                    q.device, group)
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be in [1, {MAX_SPLITS}], got {splits}")
    if splits > 1:  # partial outputs and log-sum-exps per split, merged below
        part_out = torch.empty(splits, n, hq, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, n, hq, dtype=torch.float32, device=q.device)
        dest, dest_lse, split_stride = part_out, part_lse, part_out.stride(0)
    else:
        dest, dest_lse, split_stride = out, out if lse is None else lse, 0  # (LSE unread without lse)
    _sparse_decode_kernel[(b, hkv, triton.cdiv(queries_per_request, query_block) * splits)](
        q, blocks_k, blocks_v, out_k, out_v, outlier_blocks, scratch_pages, scratch_rows, entries, k_pool, v_pool,
        window_indptr, window_indices, dest, dest_lse, scratch_rows if live is None else live,  # (LIVE unread ungated)
        sm_scale, outlier_blocks.shape[2], entries.shape[2], split_stride,
        q.stride(0), q.stride(1), blocks_k.stride(0), outlier_blocks.stride(0), outlier_blocks.stride(1),
        scratch_pages.stride(0), entries.stride(0), entries.stride(1),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1), dest.stride(-3), dest.stride(-2),
        queries_per_request, lse is not None or splits > 1, splits, GROUP=group, GROUP_PAD=group_pad,
        QUERY_BLOCK=query_block, HEAD_DIM=d, DIM_PAD=dim_pad(d), CHUNK=chunk,
        CHUNKS_PER_BLOCK=chunks_per_key_block(chunk, launch),
        BLOCK_W=32, GATED=live is not None, num_warps=launch.warps,
        **({} if launch.stages is None else {"num_stages": launch.stages}))
    if splits > 1:
        merge_splits(part_out, part_lse, out, lse)
    return out


def default_key_splits(requests: int, hkv: int, queries_per_request: int, num_outliers: int, num_entries: int,
                       chunk: int, device: torch.device, group: int) -> int:
    """The splits `sparse_decode_attention` takes for a call of these shapes (see `key_splits`)."""
    query_block, group_pad = program_rows(queries_per_request, group)
    launch = launch_for(query_block, group_pad)
    per_block = chunks_per_key_block(chunk, launch)
    programs = requests * hkv * triton.cdiv(queries_per_request, query_block)
    return key_splits(programs, triton.cdiv(num_outliers, per_block) + triton.cdiv(num_entries, per_block), device,
                      launch.least_splits)


