"""The chunk-cache plan of a step as one kernel: which selected chunks a scratch row already holds
(hits), which entries the misses go to, and the row's new contents, written in place.

shadowkv/chunk_cache.py's `plan_chunk_cache` is the reference (a sort, a search and a dozen
scatters, gathers and scans: about 20 launches a layer and step). Here one program per (request,
KV head) matches its K selected chunks against its K held entries in blocks, hands the misses the
free entries in index order (misses in selection order, as the reference does) and updates
`held` where it lives, so the step also skips the gather and the write-back of the held rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_shadowkv.kernels.padding_rows import live_row, live_rows
from sglang_shadowkv.shadowkv.chunk_cache import plan_chunk_cache

MATCH_ROWS = 32  # selected chunks matched against every held entry at once: [32, K] compares


def plan_chunk_cache_in_place_reference(held: torch.Tensor, rows: torch.Tensor, selected: torch.Tensor, live=None,
                                        hits: torch.Tensor | None = None):
    """held [rows, H, K] (one layer's scratch map), rows [R] the scratch rows of the requests,
    selected [R, H, K] (-1 padded) -> (jobs, entries), each [R, H, K] int64, as `plan_chunk_cache`
    defines them; held's rows are updated. Rows from live on (padding_rows): no jobs, no entries.
    hits [rows, 2] int64 (optional): each request's row gets its chunk-cache hits and lookups added."""
    r, h, k = selected.shape
    n = live_rows(live, r)
    long_rows = rows[:n].long()
    jobs, entries = (torch.full((r, h, k), -1, dtype=torch.int64, device=selected.device) for _ in range(2))
    if n == 0:
        return jobs, entries
    got_jobs, got_entries, new_held = plan_chunk_cache(held[long_rows].view(n * h, k), selected[:n].reshape(n * h, k))
    held[long_rows] = new_held.view(n, h, k)
    jobs[:n], entries[:n] = got_jobs.view(n, h, k), got_entries.view(n, h, k)
    if hits is not None:
        lookups = (entries[:n] >= 0).sum((1, 2))
        hits.index_add_(0, long_rows, torch.stack([lookups - (jobs[:n] >= 0).sum((1, 2)), lookups], 1))
    return jobs, entries


@triton.jit
def _plan_kernel(HELD, ROWS, SELECTED, JOBS, ENTRIES, FREE, LIVE, HITS, stride_hr, stride_hh, K,
                 K_PAD: tl.constexpr, MATCH: tl.constexpr, GATED: tl.constexpr, COUNT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    offs = tl.arange(0, K_PAD)
    in_k = offs < K
    out_at = (b * heads + h).to(tl.int64) * K
    if not live_row(LIVE, b, GATED):  # padding: no jobs, no entries
        tl.store(JOBS + out_at + offs, tl.full([K_PAD], -1, tl.int64), mask=in_k)
        tl.store(ENTRIES + out_at + offs, tl.full([K_PAD], -1, tl.int64), mask=in_k)
        return
    row = tl.load(ROWS + b).to(tl.int64)
    held_at = HELD + row * stride_hr + h * stride_hh
    held = tl.load(held_at + offs, mask=in_k, other=-1)
    kept = tl.zeros([K_PAD], tl.int32)
    for j0 in range(0, K, MATCH):  # the hits, MATCH selected chunks at a time, parked in ENTRIES
        offs_j = j0 + tl.arange(0, MATCH)
        sel = tl.load(SELECTED + out_at + offs_j, mask=offs_j < K, other=-1)
        match = (sel[:, None] == held[None, :]) & (sel[:, None] >= 0) & in_k[None, :]
        hit_entry = tl.max(tl.where(match, offs[None, :], -1), 1)
        kept = tl.maximum(kept, tl.max(match.to(tl.int32), 0))
        tl.store(ENTRIES + out_at + offs_j, hit_entry.to(tl.int64), mask=offs_j < K)
    free = (kept == 0) & in_k
    free_rank = tl.cumsum(free.to(tl.int32), 0) - 1
    tl.store(FREE + out_at + free_rank, offs, mask=free)  # FREE[n]: the n-th free entry
    tl.store(JOBS + out_at + offs, tl.full([K_PAD], -1, tl.int64), mask=in_k)
    tl.debug_barrier()
    sel = tl.load(SELECTED + out_at + offs, mask=in_k, other=-1)
    hit_entry = tl.load(ENTRIES + out_at + offs, mask=in_k, other=-1)
    miss = (sel >= 0) & (hit_entry < 0)
    miss_rank = tl.cumsum(miss.to(tl.int32), 0) - 1
    target = tl.load(FREE + out_at + miss_rank, mask=miss, other=0)
    tl.debug_barrier()
    tl.store(ENTRIES + out_at + offs, tl.where(miss, target.to(tl.int64), hit_entry), mask=in_k)
    tl.store(JOBS + out_at + target, sel, mask=miss)
    tl.store(held_at + target, sel, mask=miss)
    if COUNT:  # (counted here: as torch ops the count was five more launches a layer)
        lookups = tl.sum((sel >= 0).to(tl.int64), 0)
        tl.atomic_add(HITS + row * 2, lookups - tl.sum(miss.to(tl.int64), 0))
        tl.atomic_add(HITS + row * 2 + 1, lookups)


def plan_chunk_cache_in_place(held: torch.Tensor, rows: torch.Tensor, selected: torch.Tensor, live=None,
                              hits: torch.Tensor | None = None):
    """Triton version of `plan_chunk_cache_in_place_reference` (same arguments and results)."""
    r, h, k = selected.shape
    if held.stride(2) != 1 or not selected.is_contiguous():
        raise ValueError("held must be contiguous in its last dimension and selected contiguous")
    if hits is not None and (hits.dtype != torch.int64 or not hits.is_contiguous() or hits.shape[1:] != (2,)):
        raise ValueError(f"hits must be a contiguous [rows, 2] int64 tensor, got {tuple(hits.shape)} {hits.dtype}")
    jobs = torch.empty(r, h, k, dtype=torch.int64, device=selected.device)
    entries = torch.empty_like(jobs)
    free = torch.empty(r, h, k, dtype=torch.int32, device=selected.device)
    if selected.numel():
        _plan_kernel[(r, h)](held, rows, selected, jobs, entries, free, rows if live is None else live,
                             jobs if hits is None else hits,  # (LIVE unread ungated, HITS uncounted)
                             held.stride(0), held.stride(1), k, K_PAD=triton.next_power_of_2(k),
                             MATCH=min(MATCH_ROWS, triton.next_power_of_2(k)), GATED=live is not None,
                             COUNT=hits is not None)
    return jobs, entries
