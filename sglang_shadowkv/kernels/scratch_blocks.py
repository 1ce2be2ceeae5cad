"""Where a chunk-cache scratch entry lives: a [c, D] block of the dense pool's pages.

A layer's K (or V) memory of the dense pool, viewed as [pages * Hkv, c, D] blocks (a page's memory
is Hkv such blocks: block page·Hkv + h), holds outlier chunks and the chunk-cache scratch alike
(mem_cache/compressed_layout.py). A request's scratch row is a row of pages of the table
scratch_pages [rows, entries]: entry e of row r for KV head h is block scratch_pages[r, e]·Hkv + h.
So the scratch takes pool pages only while a request decodes, and a kernel finds an entry with one
read of a fixed device table (CUDA graphs replay it unchanged).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def scratch_blocks(scratch_pages: torch.Tensor, rows: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """Block ids [R, Hkv, K] (int64) of the entries [R, Hkv, K] of scratch rows [R]; -1 where the
    entry is -1."""
    hkv = entries.shape[1]
    heads = torch.arange(hkv, device=entries.device)[None, :, None]
    pages = scratch_pages[rows.long()[:, None, None], entries.clamp(min=0).long()].long()
    return torch.where(entries >= 0, pages * hkv + heads, -1)


def scratch_jobs(jobs: torch.Tensor, scratch_pages: torch.Tensor, scratch_rows: torch.Tensor):
    """The jobs >= 0 of a chunk fetch (jobs [B, Hkv, K]: the chunk slot to bring into entry
    (b, h, e) of scratch row scratch_rows[b], -1 for none) as (chunk slot, KV head, block id), each
    [J] int64."""
    b_idx, h_idx, e_idx = (jobs >= 0).nonzero(as_tuple=True)
    blocks = scratch_pages[scratch_rows[b_idx].long(), e_idx].long() * jobs.shape[1] + h_idx
    return jobs[b_idx, h_idx, e_idx].long(), h_idx, blocks


@triton.jit
def scratch_block(SCRATCH_PAGES, stride_sp, row, entry, h, num_heads):
    """Block id (int64) of entry `entry` (>= 0; scalar or tensor) of scratch row `row`, KV head h."""
    return tl.load(SCRATCH_PAGES + row * stride_sp + entry).to(tl.int64) * num_heads + h
