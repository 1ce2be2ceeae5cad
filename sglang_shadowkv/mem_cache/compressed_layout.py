"""Where compressed state sits inside the dense pool's pages, and its sizes.

A page of the dense pool (page_size tokens of K and V, in every layer) is either dense KV or, once
taken from the page allocator, compressed state of one of three kinds, or chunk-cache scratch:
- slot page: m chunk slots (slot s = page·m + j). Per layer a slot holds the low-rank rows of its
  c tokens (their first kv_dim/m columns in the page's K memory, the rest in its V memory), its
  landmark (the chunk's mean key, int8 with a scale or the model dtype), the scale of its host
  values and, per KV head, whether it can be selected (0 for outlier chunks).
- outlier page: per layer its K and V memory are Hkv blocks of [c, D] (block page·Hkv + h): the
  exact keys and values of one outlier chunk of each KV head.
- basis page: 2c rows of a segment's basis per layer (c in the K memory, c in the V memory).
- scratch page: one entry of a running request's chunk-cache scratch (shadowkv/decode.py takes a
  row of them per request while it runs), laid out as an outlier page: per layer the rebuilt keys
  and fetched values of one selected chunk of each KV head. Outlier and scratch pages are both
  read as the blocks ShadowKVPool.blocks_k / blocks_v.
So a document moves between its dense and compressed forms inside one pool, and the split between
the two follows what is cached (DESIGN.md §3). Outside the pages: per-slot metadata (its first
token's position, its segment, its host slot), each outlier block's position per layer, and the
values of every compressed chunk, in (page-locked on a GPU) host memory, one chunk of one KV head
one contiguous read, int8 with the slot's scale when value_dtype is int8.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SlotLayout:
    """How m chunk slots share one page: byte offsets inside a slot's share of the V memory."""
    slots_per_page: int
    lo_cols: int  # low-rank columns in the K memory
    hi_cols: int  # the rest, at the start of the V share
    record_bytes: int  # a slot's share of a page's V memory
    landmark_at: int
    landmark_scale_at: int | None
    value_scale_at: int | None
    selectable_at: int


def slot_layout(chunk_size: int, num_kv_heads: int, head_dim: int, max_rank: int, dtype: torch.dtype,
                landmark_dtype: torch.dtype, value_dtype: torch.dtype) -> SlotLayout:
    """The most slots per page (a power of two dividing the key dims) whose state fits."""
    kv_dim, elt = num_kv_heads * head_dim, element_size(dtype)
    m = 1
    while kv_dim % (2 * m) == 0:
        m *= 2
    while m >= 1:
        lo = kv_dim // m
        hi = max(0, max_rank - lo)
        at = align(chunk_size * hi * elt, 8)
        landmark_at, at = at, align(at + kv_dim * element_size(landmark_dtype), 4)
        landmark_scale_at = value_scale_at = None
        if landmark_dtype == torch.int8:
            landmark_scale_at, at = at, at + 4 * num_kv_heads
        if value_dtype == torch.int8:
            value_scale_at, at = at, at + 4 * num_kv_heads
        record = chunk_size * kv_dim * elt // m
        if at + num_kv_heads <= record:
            return SlotLayout(m, min(lo, max_rank), hi, record, landmark_at, landmark_scale_at, value_scale_at, at)
        m //= 2
    raise ValueError(f"a chunk's compressed state does not fit one page (max rank {max_rank}, {kv_dim} key dims)")


def basis_pages(max_rank: int, chunk_size: int) -> int:
    """Pages a basis takes: 2c of its rows a page (c in the K memory, c in the V memory)."""
    return -(-max_rank // (2 * chunk_size))


def segment_pages(layout: SlotLayout, num_chunks: int, num_outliers: int, max_rank: int, chunk_size: int) -> int:
    """Pages a segment takes: its slot pages, one page per outlier chunk (every KV head's), its basis."""
    return -(-num_chunks // layout.slots_per_page) + num_outliers + basis_pages(max_rank, chunk_size)


def quantize_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, Hkv, ...] (values of chunks, or landmarks) -> int8 and the float32 scale [n, Hkv] of each
    chunk and KV head (its largest magnitude / 127; x = int8 * scale)."""
    x = x.float()
    scale = x.flatten(2).abs().amax(2).clamp(min=1e-30) / 127
    per_element = scale.view(*scale.shape, *[1] * (x.dim() - 2))
    return (x / per_element).round().clamp(-127, 127).to(torch.int8), scale


def host_bytes_per_chunk(num_layers: int, num_kv_heads: int, head_dim: int, chunk_size: int,
                         value_dtype: torch.dtype) -> int:
    return num_layers * num_kv_heads * head_dim * chunk_size * element_size(value_dtype)


def values_per_page(dtype: torch.dtype, value_dtype: torch.dtype) -> int:
    """Chunks whose values (stored as value_dtype) one page of a dtype pool holds in its K and V
    memory: a compressed segment's GPU values (compressed_pool.ShadowKVPool.load_values)."""
    return 2 * (element_size(dtype) // element_size(value_dtype))


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def align(n: int, to: int) -> int:
    return -(-n // to) * to
