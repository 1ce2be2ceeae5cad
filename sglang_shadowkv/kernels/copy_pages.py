"""Copy whole KV pages of one layer between two page pools: the GPU pool and the host tier's
page-locked pool (mem_cache/host_kv_pool.py), either way.

A page is one contiguous block of page_size x Hkv x D elements in both pools, so page i of the
source goes to page j of the destination as one block. On a GPU the host side is read or written
through its mapped device address (UVA zero-copy), so a layer's pages move in one launch whatever
their order, with no staging copy and no CPU work; a load runs layer by layer on a side stream and
the forward pass of each layer waits only for its own pages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements a program moves at once


def copy_pages_reference(src: torch.Tensor, src_pages: torch.Tensor, dst: torch.Tensor,
                         dst_pages: torch.Tensor) -> torch.Tensor:
    """dst[dst_pages[i]] = src[src_pages[i]] for the [pages, page_numel] views; returns dst."""
    dst[dst_pages.to(dst.device)] = src[src_pages.to(src.device)].to(dst.device)
    return dst


@triton.jit
def _copy_pages_kernel(SRC, SRC_PAGES, DST, DST_PAGES, PAGE_NUMEL, BLOCK: tl.constexpr):
    """Program (i, b): block b of page pair i."""
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < PAGE_NUMEL
    src = tl.load(SRC_PAGES + i).to(tl.int64) * PAGE_NUMEL
    dst = tl.load(DST_PAGES + i).to(tl.int64) * PAGE_NUMEL
    tl.store(DST + dst + offs, tl.load(SRC + src + offs, mask=mask), mask=mask)


def copy_pages(src: torch.Tensor, src_pages: torch.Tensor, dst: torch.Tensor, dst_pages: torch.Tensor) -> torch.Tensor:
    """Triton version of `copy_pages_reference`; src or dst may be page-locked host memory
    (mapped: read or written over PCIe). The page lists live on the launching device."""
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(f"copy_pages takes [pages, page_numel] views of one dtype, got {tuple(src.shape)} "
                         f"{src.dtype} and {tuple(dst.shape)} {dst.dtype}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_pages: both pools must be contiguous")
    if src_pages.numel() != dst_pages.numel():
        raise ValueError(f"copy_pages: {src_pages.numel()} source pages for {dst_pages.numel()} destinations")
    n = src_pages.numel()
    if n:
        numel = src.shape[1]
        _copy_pages_kernel[(n, triton.cdiv(numel, BLOCK))](src, src_pages, dst, dst_pages, numel, BLOCK=BLOCK)
    return dst
