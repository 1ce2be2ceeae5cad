"""A decode step's chunk selection as one kernel: landmark logits -> the chunks each KV head attends,
and its budget histogram, in one launch a layer.

The reference (`select_decode_chunks_reference`) is the torch path of `SparseDecoder.attend`: a
softmax over each query head's chunk logits, the max over the KV group, `selection.select_chunks`
(a top-k, the adaptive count, a gather, a mask and a pad) and the histogram's scatter-add, about 25
launches a layer. Here one program per (request, KV head) keeps its chunk scores in registers and
finds the adaptive count and the count-th best score by bisection on the scores' bits (non-negative
floats order as their int32 bits): 31 passes of a compare and a sum each, no sort. The chosen
chunks come out in chunk order, not best first: the attention and the chunk cache do not depend
on the order. Never chosen: a chunk that is not selectable (the reference could pad a budget
larger than a head's selectable chunks with them; a budget never is, `ShadowKVConfig.budget_chunks`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_shadowkv.kernels.padding_rows import live_row, live_rows
from sglang_shadowkv.shadowkv.selection import select_chunks

FLOAT_BITS_INF = 0x7F800000  # above the bits of every finite non-negative float32
BISECTION_STEPS = 31  # halvings of [0, FLOAT_BITS_INF) down to one bit pattern


def decode_chunk_scores(logits: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, Hq, N] logits -> [B, Hkv, N] scores: each query head's softmax over the chunks, max over
    the KV group; -1 where the chunk is not selectable (its logit -inf)."""
    b, hq, n = logits.shape
    grouped = logits.view(b, kv_heads, hq // kv_heads, n)
    return grouped.softmax(-1).amax(2).masked_fill(grouped[:, :, 0].isinf(), -1.0)


def count_budgets(hist: torch.Tensor, rows: torch.Tensor, layer: int, selected: torch.Tensor) -> None:
    """Add each KV head's chunk count (selected [R, H, K], -1 padded) to hist[rows[r], layer, count]."""
    counts = (selected >= 0).sum(-1)  # [R, H]
    _, layers, width = hist.shape
    cells = (rows.long()[:, None] * layers + layer) * width + counts  # scatter_add_: no host sync
    hist.view(-1).scatter_add_(0, cells.flatten(), torch.ones_like(cells.flatten()))


def select_decode_chunks_reference(logits, kv_heads: int, chunk_slots, budgets, top_k: int, width: int,
                                   top_p: float | None, floor: int, hist, rows, layer: int,
                                   live=None) -> torch.Tensor:
    """logits [B, Hq, N] float32 (-inf where not selectable), chunk_slots [B, N] int32, budgets [B]
    (each <= top_k <= width) -> the chunk slots [B, kv_heads, width] each KV head attends (-1
    padded, best first); each head's count is added to hist [rows, layers, width + 1] at
    [rows[b], layer]. Rows from live on (padding_rows) select nothing and count nowhere."""
    n = live_rows(live, logits.shape[0])
    selected = torch.full((logits.shape[0], kv_heads, width), -1, dtype=torch.int64, device=logits.device)
    if n:
        selected[:n] = select_chunks(decode_chunk_scores(logits[:n], kv_heads), chunk_slots[:n], budgets[:n], top_k,
                                     width, top_p, floor)
        count_budgets(hist, rows[:n], layer, selected[:n])
    return selected


@triton.jit
def _highest_threshold(bits, weight, target, STEPS: tl.constexpr, BITS_INF: tl.constexpr):
    """The highest lo in [0, BITS_INF) with sum(weight where bits >= lo) >= target (non-negative
    weights), by bisection: the weight of the bits >= lo reaches the target, of those >= hi not."""
    lo = tl.zeros([], tl.int32)
    hi = tl.full([], BITS_INF, tl.int32)
    for _ in range(STEPS):
        mid = lo + (hi - lo) // 2
        reached = tl.sum(tl.where(bits >= mid, weight, 0.0), 0) >= target
        lo = tl.where(reached, mid, lo)
        hi = tl.where(reached, hi, mid)
    return lo


@triton.jit
def _select_kernel(LOGITS, SLOTS, BUDGETS, OUT, HIST, ROWS, LIVE, N, W, top_p, floor, layer, layers,
                   stride_lb, stride_lh, stride_sb,
                   GROUP: tl.constexpr, N_PAD: tl.constexpr, W_PAD: tl.constexpr, ADAPTIVE: tl.constexpr,
                   STEPS: tl.constexpr, BITS_INF: tl.constexpr, GATED: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    offs_w = tl.arange(0, W_PAD)
    out_at = OUT + (b * heads + h).to(tl.int64) * W
    if not live_row(LIVE, b, GATED):  # padding: nothing selected, nothing counted
        tl.store(out_at + offs_w, tl.full([W_PAD], -1, tl.int64), mask=offs_w < W)
        return
    offs = tl.arange(0, N_PAD)
    in_n = offs < N
    at = LOGITS + b.to(tl.int64) * stride_lb + (h * GROUP).to(tl.int64) * stride_lh
    selectable = (tl.load(at + offs, mask=in_n, other=float("-inf")) != float("-inf")) & in_n
    best = tl.zeros([N_PAD], tl.float32)
    for g in tl.static_range(GROUP):  # each query head's softmax over the chunks; max over the group
        logit = tl.load(at + g * stride_lh + offs, mask=in_n, other=float("-inf"))
        peak = tl.max(logit, 0)
        e = tl.exp(logit - tl.where(peak == float("-inf"), 0.0, peak))
        best = tl.maximum(best, e / tl.maximum(tl.sum(e, 0), 1e-30))
    score = tl.where(selectable, best, -1.0)
    bits = score.to(tl.int32, bitcast=True)  # -1 (not selectable) has negative bits
    cap = tl.minimum(tl.load(BUDGETS + b).to(tl.int32), tl.sum(selectable.to(tl.int32), 0))
    count = cap
    if ADAPTIVE:  # the fewest best chunks whose mass reaches top_p of the head's mass
        target = top_p * tl.sum(tl.maximum(score, 0.0), 0)
        lo = _highest_threshold(bits, score, target, STEPS, BITS_INF)  # mass of the scores >= lo reaches it
        needed = tl.where(target > 0, tl.sum((bits >= lo).to(tl.int32), 0), 0)
        count = tl.minimum(tl.maximum(needed, tl.minimum(floor, cap)), cap)
    # the count-th best score: at least count scores >= lo (a float sum of ones: exact up to 2**24 chunks)
    lo = _highest_threshold(bits, tl.full([N_PAD], 1.0, tl.float32), count.to(tl.float32), STEPS, BITS_INF)
    above = bits > lo
    tie = bits == lo  # ties at the count-th score, taken in chunk order
    tie_rank = tl.cumsum(tie.to(tl.int32), 0) - 1
    take = above | (tie & (tie_rank < count - tl.sum(above.to(tl.int32), 0)))  # none when count is 0: lo ends above every score
    position = tl.cumsum(take.to(tl.int32), 0) - 1
    slots = tl.load(SLOTS + b.to(tl.int64) * stride_sb + offs, mask=take, other=0)
    tl.store(out_at + position, slots.to(tl.int64), mask=take)
    tl.store(out_at + offs_w, tl.full([W_PAD], -1, tl.int64), mask=(offs_w >= count) & (offs_w < W))
    row = tl.load(ROWS + b).to(tl.int64)
    tl.atomic_add(HIST + (row * layers + layer) * (W + 1) + count, tl.full([], 1, tl.int64))


def compile_class(n: int) -> tuple[int, int]:
    """What of a step's chunk columns n the selection kernel is compiled for (its register row and
    warps): steps whose n share a class share one compiled variant; a new class costs a Triton
    compile (~1-2 s on the H100) the first time it is met."""
    return triton.next_power_of_2(n), 4 if n <= 1024 else 8 if n <= 8192 else 16


def select_decode_chunks(logits, kv_heads: int, chunk_slots, budgets, top_k: int, width: int,
                         top_p: float | None, floor: int, hist, rows, layer: int, live=None) -> torch.Tensor:
    """Triton version of `select_decode_chunks_reference` (same arguments; the chosen chunks in
    chunk order, not best first). top_k only bounds the budgets there: here the budget is the cap."""
    b, hq, n = logits.shape
    out = torch.empty(b, kv_heads, width, dtype=torch.int64, device=logits.device)
    if hist.shape[2] != width + 1:
        raise ValueError(f"hist must have width + 1 = {width + 1} columns, has {hist.shape[2]}")
    if logits.stride(2) != 1 or chunk_slots.stride(1) != 1:
        raise ValueError("logits and chunk_slots must be contiguous in their last dimension")
    if b and n:
        n_pad, warps = compile_class(n)
        _select_kernel[(b, kv_heads)](
            logits, chunk_slots, budgets, out, hist, rows, rows if live is None else live,  # (LIVE unread ungated)
            n, width, 0.0 if top_p is None else top_p, floor, layer, hist.shape[1], logits.stride(0), logits.stride(1), chunk_slots.stride(0),
            GROUP=hq // kv_heads, N_PAD=n_pad, W_PAD=triton.next_power_of_2(width),
            ADAPTIVE=top_p is not None, STEPS=BISECTION_STEPS, BITS_INF=FLOAT_BITS_INF, GATED=live is not None,
            num_warps=warps)
    elif b:
        out.fill_(-1)
    return out
