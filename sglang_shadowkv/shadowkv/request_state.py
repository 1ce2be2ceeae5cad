"""What ShadowKV keeps for one running request between steps, and the layout of its prefix.

A request's prefix may mix dense pages and compressed chunks of several segments (a document
compressed by an earlier request, then its own long prompt); `CompressedLayout` is what sparse
decode needs to know of that mix. It is fixed once the prompt is done: every later token is dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import groupby

import torch
from torch.nn.utils.rnn import pad_sequence

from sglang_shadowkv.mem_cache.compressed_pool import ChunkRef, Segment
from sglang_shadowkv.mem_cache.copy_loads import CopyLoad

from .config import ShadowKVConfig


@dataclass
class CompressedLayout:
    chunk_slots: torch.Tensor  # [n] chunk slots of every compressed chunk of the prefix, in order
    outlier_blocks: torch.Tensor  # [Hkv, O] int32 outlier blocks of its segments
    outlier_lo: torch.Tensor  # [Hkv, O] int32: a block counts only if its chunk starts in [lo, hi),
    outlier_hi: torch.Tensor  # the part of its segment this prefix holds
    dense_spans: list[tuple[int, int]]  # dense token spans before `compressed_end`
    compressed_end: int  # every token from here on is dense
    segments: list[Segment] = field(default_factory=list)
    segment_chunks: list[int] = field(default_factory=list)  # chunks of each segment it holds
    # which chunks of which segments, in order: equal for two prefixes of the same chunks (their
    # chunk_slots equal), without reading a device tensor
    chunks_key: tuple = ()

    @property
    def num_chunks(self) -> int:
        return self.chunk_slots.numel()

    @property
    def num_outliers(self) -> int:
        return self.outlier_blocks.shape[1]


def build_layout(entries: list, chunk_size: int) -> CompressedLayout | None:
    """Layout of a prefix given one entry per page (page id or ChunkRef); None if all dense.

    One pass over runs of entries (a document is one run of a segment's chunks), so a 32K-token
    prefix costs a few runs, not one Python step per page."""
    dense_spans, pieces, pos = [], [], 0  # pieces: (segment, first chunk index, count)
    for is_ref, run in groupby(entries, key=lambda e: type(e) is ChunkRef):
        run = list(run)
        if not is_ref:
            dense_spans.append((pos * chunk_size, (pos + len(run)) * chunk_size))
        else:
            for _, refs in groupby(run, key=lambda r: id(r.segment)):
                refs = list(refs)
                pieces.append((refs[0].segment, [r.index for r in refs]))
        pos += len(run)
    if not pieces:
        return None
    by_segment: dict[int, tuple[Segment, list[int]]] = {}
    for seg, indices in pieces:
        by_segment.setdefault(id(seg), (seg, []))[1].extend(indices)
    last_ref = len(entries) - next(i for i, e in enumerate(reversed(entries)) if type(e) is ChunkRef)
    end = last_ref * chunk_size
    dense_spans = [(a, b) for a, b in dense_spans if b <= end]
    slots, blocks, los, his, key = [], [], [], [], []
    for seg, indices in by_segment.values():
        first, last = indices[0], indices[-1]
        if last - first + 1 == len(indices):  # consecutive chunks (the usual case): a slice
            slots.append(seg.chunk_slots[first:last + 1])
            key.append((id(seg), first, last + 1))
        else:
            slots.append(seg.chunk_slots[torch.tensor(indices, device=seg.chunk_slots.device)])
            key.append((id(seg), tuple(indices)))
        blocks.append(seg.outlier_blocks)
        lo, hi = seg.start + min(indices) * chunk_size, seg.start + (max(indices) + 1) * chunk_size
        los.append(torch.full_like(seg.outlier_blocks, lo))
        his.append(torch.full_like(seg.outlier_blocks, hi))
    return CompressedLayout(torch.cat(slots), torch.cat(blocks, 1), torch.cat(los, 1), torch.cat(his, 1),
                            dense_spans, end, [seg for seg, _ in by_segment.values()],
                            [len(indices) for _, indices in by_segment.values()], tuple(key))


def segment_layout(seg: Segment, chunk_size: int) -> CompressedLayout:
    """Layout of a prefix that is dense up to the segment and then the whole segment."""
    entries = [0] * (seg.start // chunk_size) + [ChunkRef(seg, i) for i in range(seg.num_chunks)]
    return build_layout(entries, chunk_size)


def pad_outliers(layouts: list[CompressedLayout | None], num_kv_heads: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, Hkv, Omax] outlier blocks (-1 padded; none for a dense request's None) and their
    position bounds."""
    none = torch.zeros(0, num_kv_heads, dtype=torch.int32, device=device)

    def pad(name: str, value: int) -> torch.Tensor:
        rows = [none if lay is None else getattr(lay, name).T for lay in layouts]
        return pad_sequence(rows, batch_first=True, padding_value=value).permute(0, 2, 1).contiguous()

    return pad("outlier_blocks", -1), pad("outlier_lo", 0), pad("outlier_hi", 0)


def selection_tables(layouts: list[CompressedLayout | None], cfg: ShadowKVConfig, null_slot: int,
                     num_kv_heads: int, device: torch.device):
    """What a step's chunk selection reads per request: chunk slots [R, Nmax] int32 (padded with
    the null slot, never selectable; none for a dense request's None), the outliers of
    `pad_outliers`, and the budget (chunks per KV head; 0 for None) as a list."""
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    slots = pad_sequence([empty if lay is None else lay.chunk_slots.int() for lay in layouts], batch_first=True,
                         padding_value=null_slot)
    budgets = [0 if lay is None else cfg.budget_chunks(lay.num_chunks - lay.num_outliers) for lay in layouts]
    return slots, pad_outliers(layouts, num_kv_heads, device), budgets


def copy_padded(dst: torch.Tensor, src: torch.Tensor, fill: int) -> None:
    """dst (a fixed buffer of a CUDA-graph plan) = src in its leading corner, `fill` elsewhere."""
    dst.fill_(fill)
    dst[tuple(slice(0, n) for n in src.shape)].copy_(src)


@dataclass
class ShadowKVReqState:
    scratch_row: int  # the request's chunk-cache scratch in the SparseDecoder
    segment: Segment | None = None  # its own prompt span to compress at prefill (None: nothing)
    compress_now: bool = False  # this step completes the prompt: compress after each layer's attention
    # its compressed prefix (None: none yet): the matched one from admission, then with its own
    # segment once the prompt is done; the suffix prefill and decode read it
    layout: CompressedLayout | None = None
    exact_prefill: bool = False  # its suffix attends every compressed chunk (suffix_prefill.py)
    # its prefix's exact copy loaded into dense pages while its prompt is prefilled (mem_cache/copy_loads.py)
    copy_load: CopyLoad | None = None

    @property
    def reads_compressed(self) -> bool:
        """Whether its attention now takes ShadowKV's sparse paths: it has a compressed prefix and
        is not prefilling over that prefix's copy loaded dense (then it is a dense prompt)."""
        return self.layout is not None and self.copy_load is None
