"""The compressed-segment store, inside the dense KV pool's pages: one GPU budget for both forms.

A page of the dense pool holds dense KV or, once this store takes it from the page allocator,
compressed state: slot pages, outlier pages and basis pages (compressed_layout.py says how); the
sparse decoder takes scratch pages from the same allocator while compressed requests run.
A segment is a chunk-aligned span of one prompt compressed with one basis per layer; its state
is addressed by chunk slot, so kernels serve a whole batch with one launch. One slot page is kept
zero and never handed out: `null_slot`, the padding target of chunk tables (never selectable).

Parked segments: under extreme pressure a segment no request reads can leave the GPU whole: the
host tier (mem_cache/host_kv_pool.py) takes copies of its pages (`detach` then frees them, keeping
what lies outside them: the outlier blocks' positions), and a request that matches it has them
copied into new pages (`attach` places the segment there: its slots, outlier blocks and basis take
the new pages' ids). Its host values and id stay taken meanwhile, so it comes back as it was.

GPU values: a compressed segment's values live in the host pool, and, while the dense pool has
pages to spare, also in pages lent by it (load_values): a page's K and V memory hold
`values_per_page` chunks of every layer in the host format, bit for bit the host's, which the
value gather reads at HBM speed instead of over PCIe. Lent pages count as free: an allocation that
needs them takes them back (drop_values), and the segment is read from the host again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterable

import torch

from sglang_shadowkv.kernels.quantize_chunks import chunk_major, quantize_chunks, quantize_chunks_reference

from .compressed_layout import (basis_pages, element_size, quantize_per_head, segment_pages, slot_layout,
                                values_per_page)
from .copy_loads import CopyLoads
from .exact_copies import ExactCopies
from .host_kv_pool import HostEntry
from .host_memory import PinnedHostTensor, contiguous_runs
from .kv_pool import PagedKVPool, to_device


@dataclass
class Segment:
    seg_id: int  # also the id of its basis
    start: int  # position of the first token
    num_tokens: int
    chunk_slots: torch.Tensor  # [n] int64 on the pool's device, in token order
    outlier_blocks: torch.Tensor  # [Hkv, outliers] int32 outlier blocks, shared by every layer
    pages: list[int]  # every dense-pool page it holds (slot, outlier and basis pages)
    host_slots: list[int]  # host value slot of each chunk, in token order
    # per layer, filled by compression: 0-dim device tensors until `settle_ranks` reads them at once
    ranks: list = field(default_factory=list)
    host_runs: list[tuple[int, int, int]] = field(default_factory=list)  # (first host slot, count, chunk offset)
    value_pages: list[int] = field(default_factory=list)  # pages lent for its GPU values (none: host only)
    last_use: int = 0  # when it was last compressed or matched (which GPU values are given back first)
    refs: int = 0  # live ChunkRefs (radix tree entries and running requests'); freed at 0
    unlocked_tree_refs: int = 0  # of those, the ones in radix-tree nodes no request holds
    droppable: bool = False  # every reference is an unlocked tree entry: evicting frees its pages
    ranks_on_host: tuple | None = None  # (event, pinned tensor): the ranks' copy started by stage_ranks
    host_pages: list[int] | None = None  # parked: the host-tier pages holding its pages' copies (pages is [])
    parked_outlier_pos: torch.Tensor | None = None  # parked: outlier_pos of its blocks, per layer
    copy_slots: list[int] = field(default_factory=list)  # its exact copy's slots (none: no copy; exact_copies.py)
    copy_runs: list[tuple[int, int, int]] = field(default_factory=list)  # as host_runs, of copy_slots

    @property
    def parked(self) -> bool:
        return self.host_pages is not None

    @property
    def num_chunks(self) -> int:
        return self.chunk_slots.numel()

    @property
    def num_outliers(self) -> int:
        """Outlier chunks per KV head."""
        return self.outlier_blocks.shape[1]

    def stage_ranks(self) -> None:
        """Start copying the per-layer ranks to the host, queued right after the compression that
        set them: a plain read later would wait for everything the stream runs by then (the
        steps launched since), where this waits for the compression alone. Off a GPU they are
        read at once."""
        stacked = torch.stack([torch.as_tensor(r).to(self.chunk_slots.device) for r in self.ranks])
        if not stacked.is_cuda:
            self.ranks = stacked.tolist()
            return
        host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
        host.copy_(stacked, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.ranks_on_host = (event, host)

    def ranks_ready(self) -> bool:
        """Whether settle_ranks returns without waiting for the device."""
        return self.ranks_on_host is None or self.ranks_on_host[0].query()

    def settle_ranks(self) -> list[int]:
        """The per-layer ranks as ints, once their copy (stage_ranks) has landed (compression
        leaves them on the device, so its layers queue without a host sync each)."""
        if self.ranks_on_host is not None:
            event, host = self.ranks_on_host
            event.synchronize()
            self.ranks, self.ranks_on_host = host.tolist(), None
        return self.ranks


@dataclass(eq=False)
class ChunkRef:
    """Tokens of one page held compressed: chunk `index` of `segment` (page size = chunk size).
    The radix tree and requests keep these in place of dense page ids."""
    segment: Segment
    index: int


@dataclass(eq=False)
class ParkedChunkRef(ChunkRef, HostEntry):
    """A ChunkRef whose segment is parked: a host entry for the radix tree (only the tree holds a
    parked segment's chunks), still a reference that keeps its segment."""


class ShadowKVPool:
    def __init__(self, kv: PagedKVPool, max_rank: int, host_chunks: int, max_segments: int,
                 value_dtype: torch.dtype | None = None, landmark_dtype: torch.dtype | None = None,
                 copy_chunks: int = 0):
        k0 = kv.k_buffers[0]
        self.kv, self.dtype, self.device = kv, k0.dtype, kv.device
        self.chunk_size = c = kv.page_size
        self.num_kv_heads, self.head_dim = h, d = k0.shape[1], k0.shape[2]
        self.num_layers, self.max_rank, self.max_segments = len(kv.k_buffers), max_rank, max_segments
        kv_dim = h * d
        value_dtype = _storage_dtype("value_dtype", value_dtype, self.dtype)
        landmark_dtype = _storage_dtype("landmark_dtype", landmark_dtype, self.dtype)
        self.layout = lay = slot_layout(c, h, d, max_rank, self.dtype, landmark_dtype, value_dtype)
        m, pages = lay.slots_per_page, kv.num_pages
        self.num_slots = pages * m
        self.basis_pages_per_segment = basis_pages(max_rank, c)

        def record_field(layer: int, at: int, width: int, dt: torch.dtype) -> torch.Tensor:
            raw = kv.v_buffers[layer].view(torch.uint8).view(self.num_slots, lay.record_bytes)
            return raw[:, at:at + width * element_size(dt)].view(dt)

        self.a_lo = [kv.k_buffers[i].view(self.num_slots, c, kv_dim // m)[:, :, :lay.lo_cols]
                     for i in range(self.num_layers)]
        self.a_hi = [record_field(i, 0, c * lay.hi_cols, self.dtype).view(self.num_slots, c, lay.hi_cols)
                     for i in range(self.num_layers)]
        self.landmarks = [record_field(i, lay.landmark_at, kv_dim, landmark_dtype).view(self.num_slots, h, d)
                          for i in range(self.num_layers)]
        self.landmark_scale = None if lay.landmark_scale_at is None else [
            record_field(i, lay.landmark_scale_at, h, torch.float32) for i in range(self.num_layers)]
        self.value_scale = None if lay.value_scale_at is None else [
            record_field(i, lay.value_scale_at, h, torch.float32) for i in range(self.num_layers)]
        self.selectable = [record_field(i, lay.selectable_at, h, torch.int8) for i in range(self.num_layers)]
        # every page's K and V memory as Hkv [c, D] blocks (block page·Hkv + h): outlier chunks and
        # the sparse decoder's chunk-cache scratch
        self.blocks_k = [buf.view(pages * h, c, d) for buf in kv.k_buffers]
        self.blocks_v = [buf.view(pages * h, c, d) for buf in kv.v_buffers]
        ints = dict(dtype=torch.int32, device=self.device)
        self.outlier_pos = [torch.zeros(pages * h, **ints) for _ in range(self.num_layers)]
        self.basis_pages = torch.zeros(max_segments, self.basis_pages_per_segment, **ints)
        # each basis's rank (<= max_rank): key rebuilds read only that many low-rank columns
        self.basis_rank = [torch.zeros(max_segments, **ints) for _ in range(self.num_layers)]
        self.chunk_pos = torch.zeros(self.num_slots, **ints)
        self.chunk_basis = torch.zeros(self.num_slots, **ints)
        self.host_slot = torch.zeros(self.num_slots, **ints)
        host_shape = (host_chunks + 1, h, c, d)  # host slot 0: padding
        if self.device.type == "cuda":  # page-locked at the exact size; unpinned when the pool goes
            self._host_owners = [PinnedHostTensor(host_shape, value_dtype) for _ in range(self.num_layers)]
            self.host_v = [owner.tensor for owner in self._host_owners]
        else:
            self._host_owners = []
            self.host_v = [torch.zeros(host_shape, dtype=value_dtype) for _ in range(self.num_layers)]
        self._free_host = list(range(host_chunks, 0, -1))
        self._free_segments = list(range(max_segments - 1, -1, -1))
        self.null_page = self._take_pages(1)[0]
        self.null_slot = self.null_page * m
        for layer in range(self.num_layers):  # a zero page: nothing selectable, nothing to read
            kv.k_buffers[layer][self.null_page * c:(self.null_page + 1) * c].zero_()
            kv.v_buffers[layer][self.null_page * c:(self.null_page + 1) * c].zero_()
        self.elt, self.host_elt = element_size(self.dtype), self.host_v[0].element_size()
        # GPU values: each layer's K and V memory as [blocks, Hkv, c, D] in the host format; chunk
        # slot s is read from block value_home[s] >> 1 of the K (even) or V (odd) view, -1: host only
        self.values_per_page = values_per_page(self.dtype, value_dtype)
        half = self.values_per_page // 2
        self.resident_k = [buf.view(-1).view(value_dtype).view(pages * half, h, c, d) for buf in kv.k_buffers]
        self.resident_v = [buf.view(-1).view(value_dtype).view(pages * half, h, c, d) for buf in kv.v_buffers]
        self.value_home = torch.full((self.num_slots,), -1, **ints)
        self.d2h_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.h2d_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None  # GPU values
        self.live: dict[int, Segment] = {}  # allocated segments by id
        # exact copies of the segments' keys (and values, unless the host pool holds them exactly)
        self.copies = ExactCopies(self.num_layers, h, c, d, self.dtype, copy_chunks, value_dtype != self.dtype,
                                  self.num_slots, self.device) if copy_chunks else None
        # those copies loaded into dense pages for the prefill of questions on them (none without copies)
        self.copy_loads = CopyLoads(self)

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def chunk_capacity(self) -> int:
        """Chunks the host value pool holds (the GPU side shares the dense pool's pages)."""
        return len(self.host_v[0]) - 1

    @property
    def free_chunks(self) -> int:
        return len(self._free_host)

    @property
    def free_segments(self) -> int:
        return len(self._free_segments)

    def pages_for(self, num_chunks: int, num_outliers: int) -> int:
        """Dense-pool pages a segment of num_chunks chunks takes."""
        return segment_pages(self.layout, num_chunks, num_outliers, self.max_rank, self.chunk_size)

    def free_ids(self) -> dict[str, list[int]]:
        """Free segment ids, host slots and exact copy slots (copies; for accounting checks)."""
        return {"segments": list(self._free_segments), "host_slots": list(self._free_host),
                **({} if self.copies is None else {"copy_slots": self.copies.free_ids()})}

    # ---- segments ------------------------------------------------------------------------------
    def parked_segments(self) -> list[Segment]:
        """The live segments parked in the host tier."""
        return [seg for seg in self.live.values() if seg.parked]

    @property
    def parked_chunks(self) -> int:
        """Host value slots that parked segments hold (dropping them frees these)."""
        return sum(seg.num_chunks for seg in self.parked_segments())

    def can_alloc(self, num_chunks: int, num_outliers: int, reclaimable_chunks: int = 0) -> bool:
        """Whether a segment fits: its host value slots (counting reclaimable_chunks more), an id,
        and its pages among the free ones."""
        return (num_chunks <= len(self._free_host) + reclaimable_chunks and bool(self._free_segments)
                and self.pages_for(num_chunks, num_outliers) <= self.kv.num_free)

    def alloc_segment(self, start: int, num_tokens: int, num_outliers: int, keep_copies=()) -> Segment | None:
        """Take the pages, host slots and id of a segment (None, nothing taken, when any is short),
        and an exact copy's slots when the copies can make room without the copies of keep_copies
        (segments a request is about to read)."""
        n = num_tokens // self.chunk_size
        if num_tokens % self.chunk_size or not self.can_alloc(n, num_outliers):
            return None
        pages = self._take_pages(self.pages_for(n, num_outliers))
        host = [self._free_host.pop() for _ in range(n)]
        seg = Segment(self._free_segments.pop(), start, num_tokens, torch.empty(n, dtype=torch.int64),
                      torch.empty(self.num_kv_heads, num_outliers, dtype=torch.int32), pages, host,
                      ranks=[0] * self.num_layers, host_runs=contiguous_runs(host))
        if self.copies is not None:
            self.copies.take(seg, keep_copies)
        self._place(seg, pages)
        self.live[seg.seg_id] = seg
        return seg

    def _place(self, seg: Segment, pages: list[int]) -> None:
        """Address a segment by its pages (slot pages, outlier pages, basis pages, in that order):
        its chunk slots, outlier blocks and basis page table, and each slot's metadata."""
        n, m, h = seg.num_chunks, self.layout.slots_per_page, self.num_kv_heads
        slot_pages, pages = pages[:-(-n // m)], pages[-(-n // m):]
        outlier_pages, basis_pages = pages[:seg.num_outliers], pages[seg.num_outliers:]
        slots = torch.tensor([p * m + j for p in slot_pages for j in range(m)][:n], dtype=torch.int64)
        blocks = torch.tensor(outlier_pages, dtype=torch.int32)[None, :] * h + torch.arange(h, dtype=torch.int32)[:, None]
        seg.chunk_slots, seg.outlier_blocks = to_device(slots, self.device), to_device(blocks, self.device)
        self.basis_pages[seg.seg_id] = to_device(torch.tensor(basis_pages, dtype=torch.int32), self.device)
        self.chunk_pos[seg.chunk_slots] = (seg.start + torch.arange(n, device=self.device) * self.chunk_size).int()
        self.chunk_basis.index_fill_(0, seg.chunk_slots, seg.seg_id)  # (`t[idx] = int` copies a host scalar: a wait)
        self.host_slot[seg.chunk_slots] = to_device(torch.tensor(seg.host_slots, dtype=torch.int32), self.device)
        if self.copies is not None:
            self.copies.place(seg)

    # ---- parking: a segment's GPU state in host memory ---------------------------------------------
    def detach(self, seg: Segment, host_pages: list[int]) -> int:
        """The segment's pages were copied to these host-tier pages: free them (its GPU values
        too), keeping the outlier blocks' positions, which live outside its pages. Returns the
        dense-pool pages freed."""
        self.drop_values(seg)
        blocks = seg.outlier_blocks.long()
        seg.parked_outlier_pos = torch.stack([pos[blocks] for pos in self.outlier_pos])  # small: kept on the device
        freed, seg.host_pages = seg.pages, list(host_pages)
        self.kv.free(freed)
        seg.pages = []
        return len(freed)

    def attach(self, seg: Segment, pages: list[int]) -> None:
        """The parked segment's pages were copied back into these new pages: address it there."""
        self._place(seg, pages)
        for pos, saved in zip(self.outlier_pos, seg.parked_outlier_pos):
            pos[seg.outlier_blocks.long()] = saved
        seg.pages, seg.host_pages, seg.parked_outlier_pos = list(pages), None, None

    def chunk_refs(self, seg: Segment) -> list[ChunkRef]:
        """One reference per chunk of a compressed segment; the segment lives while any does."""
        seg.refs += seg.num_chunks
        return [ChunkRef(seg, i) for i in range(seg.num_chunks)]

    def release_chunks(self, refs: list[ChunkRef]) -> int:
        """Drop references; returns the dense-pool pages freed (segments whose last went)."""
        freed = 0
        for ref in refs:
            ref.segment.refs -= 1
            if ref.segment.refs == 0:
                freed += len(ref.segment.pages)
                self.free_segment(ref.segment)
            elif ref.segment.refs < 0:
                raise RuntimeError("ShadowKV pool: a chunk reference was released twice")
        return freed

    def free_segment(self, seg: Segment) -> None:
        """Give back its pages, host value slots and id (a parked one's host-tier pages are its
        releaser's: CacheManager)."""
        self.drop_values(seg)
        if self.copies is not None:
            self.copies.drop(seg)
        del self.live[seg.seg_id]
        self.kv.free(seg.pages)
        self._free_host.extend(reversed(seg.host_slots))
        self._free_segments.append(seg.seg_id)

    def _take_pages(self, n: int) -> list[int]:
        pages = self.kv.alloc(n)
        if pages is None:
            raise RuntimeError(f"ShadowKV pool: {n} pages asked, {self.kv.num_free} free")
        return pages

    # ---- writes and reads of a segment's state ---------------------------------------------------
    def write_lowrank(self, layer: int, seg: Segment, rows: torch.Tensor) -> None:
        """The segment's low-rank rows [num_tokens, max_rank] into its slots (K and V shares)."""
        rows = rows.to(self.dtype).view(seg.num_chunks, self.chunk_size, -1)
        lo = self.layout.lo_cols
        self.a_lo[layer][seg.chunk_slots] = rows[:, :, :lo]
        if self.layout.hi_cols:
            self.a_hi[layer][seg.chunk_slots] = rows[:, :, lo:lo + self.layout.hi_cols]

    def lowrank_rows(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """[len(slots), c, max_rank] low-rank rows of chunk slots (the torch reference's read)."""
        parts = [self.a_lo[layer][slots]] + ([self.a_hi[layer][slots]] if self.layout.hi_cols else [])
        return torch.cat(parts, 2)

    def write_basis(self, layer: int, seg: Segment, basis: torch.Tensor) -> None:
        """The segment's basis [max_rank, kv_dim] (zero past its rank) into its basis pages."""
        c = self.chunk_size
        rows = torch.zeros(self.basis_pages_per_segment * 2 * c, basis.shape[1], dtype=self.dtype, device=self.device)
        rows[:basis.shape[0]] = basis
        rows = rows.view(-1, 2, c, basis.shape[1])
        pages = self.basis_pages[seg.seg_id].long()
        self._page_rows(self.kv.k_buffers[layer])[pages] = rows[:, 0]
        self._page_rows(self.kv.v_buffers[layer])[pages] = rows[:, 1]

    def basis_memory(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K pages, V pages, basis page table): where a layer's bases lie (kernels/rebuild_keys.py)."""
        return self._page_rows(self.kv.k_buffers[layer]), self._page_rows(self.kv.v_buffers[layer]), self.basis_pages

    def _page_rows(self, buffer: torch.Tensor) -> torch.Tensor:
        """A K or V buffer [tokens, Hkv, D] as [pages, c, kv_dim]."""
        return buffer.view(self.kv.num_pages, self.chunk_size, -1)

    def write_host_values(self, layer: int, seg: Segment, values: torch.Tensor) -> None:
        """Copy the segment's values [num_tokens, Hkv, D] (token-major, as the dense pool holds
        them) into its host chunks in the host format ([n, Hkv, c, D], int8 with scales when the
        pool is int8)."""
        if self.value_scale is not None:
            quantize = quantize_chunks if values.is_cuda else quantize_chunks_reference
            values, scale = quantize(values, self.chunk_size)
            self.value_scale[layer][seg.chunk_slots] = scale
        else:
            values = chunk_major(values, self.chunk_size).to(self.host_v[layer].dtype).contiguous()
        self._write_host_runs(self.host_v[layer], seg.host_runs, values)

    def has_copies(self, segments: Iterable[Segment]) -> bool:
        """Whether every one of these segments has an exact copy (a question over them reads it)."""
        return self.copies is not None and all(seg.copy_slots for seg in segments)

    def write_exact_copy(self, layer: int, seg: Segment, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy the segment's post-RoPE keys and values [num_tokens, Hkv, D], as the dense pool held
        them, into its exact copy (nothing without one; values only where the host pool rounds them)."""
        if self.copies is None or not seg.copy_slots:
            return
        self._write_host_runs(self.copies.k[layer], seg.copy_runs, chunk_major(keys.to(self.dtype), self.chunk_size))
        if self.copies.v is not None:
            self._write_host_runs(self.copies.v[layer], seg.copy_runs,
                                  chunk_major(values.to(self.dtype), self.chunk_size))

    def _write_host_runs(self, host: torch.Tensor, runs: list[tuple[int, int, int]], chunks: torch.Tensor) -> None:
        """chunks [n, Hkv, c, D] into host slots: one copy per run of consecutive slots. On the GPU
        the copies go on a side stream straight into pinned memory, so they overlap the next layers'
        work; `wait_host_writes` orders later readers."""
        chunks = chunks.contiguous()
        on_side = self.d2h_stream is not None and chunks.is_cuda
        if on_side:
            self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h_stream) if on_side else contextlib.nullcontext():
            for first, count, offset in runs:
                host[first:first + count].copy_(chunks[offset:offset + count], non_blocking=on_side)
        if on_side:
            chunks.record_stream(self.d2h_stream)

    def read_host_values(self, layer: int, seg: Segment, first: int, count: int) -> torch.Tensor:
        """Values [count, Hkv, c, D] of chunks first..first+count-1 of a segment, on the pool's
        device: one copy per run of consecutive host slots."""
        values = self._read_host_runs(self.host_v[layer], seg.host_runs, first, count)
        if self.value_scale is None:
            return values
        scale = self.value_scale[layer][seg.chunk_slots[first:first + count]]
        return (values.float() * scale[:, :, None, None]).to(self.dtype)

    def read_exact_copy(self, layer: int, seg: Segment, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [count, Hkv, c, D] of chunks first..first+count-1 of a segment with an
        exact copy, on the pool's device, as the dense pool held them (values from the host pool
        where it holds them exactly)."""
        keys = self._read_host_runs(self.copies.k[layer], seg.copy_runs, first, count)
        if self.copies.v is None:
            return keys, self.read_host_values(layer, seg, first, count)
        return keys, self._read_host_runs(self.copies.v[layer], seg.copy_runs, first, count)

    def _read_host_runs(self, host: torch.Tensor, runs: list[tuple[int, int, int]], first: int,
                        count: int) -> torch.Tensor:
        """Chunks first..first+count-1 [count, ...] of host slots laid out in runs (first slot,
        count, chunk offset): one copy per run they touch, asynchronous from pinned memory."""
        parts = []
        for slot, run, offset in runs:
            lo, hi = max(first, offset), min(first + count, offset + run)
            if lo < hi:
                parts.append(host[slot + lo - offset:slot + hi - offset].to(self.device, non_blocking=True))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def write_landmarks(self, layer: int, seg: Segment, landmarks: torch.Tensor) -> None:
        """Store the segment's landmarks [n, Hkv, D] (an int8 pool quantises them with their scales)."""
        if self.landmark_scale is not None:
            landmarks, scale = quantize_per_head(landmarks)
            self.landmark_scale[layer][seg.chunk_slots] = scale
        self.landmarks[layer][seg.chunk_slots] = landmarks.to(self.landmarks[layer].dtype)

    def landmarks_of(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """[..., Hkv, D] float32 landmarks of chunk slots, scales applied."""
        out = self.landmarks[layer][slots].float()
        if self.landmark_scale is not None:
            out = out * self.landmark_scale[layer][slots][..., None]
        return out

    def wait_host_writes(self) -> None:
        """Make the current stream wait for the value copies of finished compressions."""
        if self.d2h_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.d2h_stream)

    # ---- GPU values ----------------------------------------------------------------------------
    def value_pages_for(self, num_chunks: int) -> int:
        return -(-num_chunks // self.values_per_page)

    def resident(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(value_home, K blocks, V blocks) of a layer: the value gather's `resident` argument."""
        return self.value_home, self.resident_k[layer], self.resident_v[layer]

    def load_values(self, seg: Segment) -> bool:
        """Copy a compressed segment's values from the host pool into pages lent by the dense pool
        (False, nothing taken, when too few pages are unused): one host-to-device copy per run of
        host slots and layer. On a GPU they go on a stream of their own, overlapping the next
        steps; each chunk's home is written after its values, so a step reads it from the host
        until then (drop_values orders the pages' next owner after the copies)."""
        if seg.value_pages:
            return True
        n, vpp = seg.num_chunks, self.values_per_page
        pages = self.kv.lend(self.value_pages_for(n))
        if pages is None:
            return False
        half, at = vpp // 2, torch.arange(n) % vpp
        block = torch.tensor(pages, dtype=torch.int64).repeat_interleave(vpp)[:n] * half + at % half
        side = (at >= half).long()  # 0: K memory, 1: V memory
        in_k, in_v = (side == 0).nonzero().flatten(), (side == 1).nonzero().flatten()
        self.wait_host_writes()
        if self.h2d_stream is not None:
            self.h2d_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.h2d_stream) if self.h2d_stream is not None else contextlib.nullcontext():
            # one page-locked copy of the index tables: a pageable one would make the host wait for
            # the step just launched (the one that compressed this segment), every compression
            tables = to_device(torch.cat([in_k, in_v, block[in_k], block[in_v], block * 2 + side]), self.device)
            in_k, in_v, k_blocks, v_blocks, home = tables.split([len(in_k), len(in_v), len(in_k), len(in_v), n])
            for layer in range(self.num_layers):
                values = torch.cat([self.host_v[layer][first:first + count].to(self.device, non_blocking=True)
                                    for first, count, _ in seg.host_runs])  # runs are in chunk order
                self.resident_k[layer][k_blocks] = values[in_k]
                self.resident_v[layer][v_blocks] = values[in_v]
            self.value_home[seg.chunk_slots] = home.int()
        seg.value_pages = pages
        return True

    def drop_values(self, seg: Segment) -> int:
        """Give a segment's value pages back to the dense pool (its values are read from the host
        from the next step on); returns the pages given back."""
        pages, seg.value_pages = seg.value_pages, []
        if pages:
            if self.h2d_stream is not None:  # the pages' next owner writes after the copies into them
                torch.cuda.current_stream(self.device).wait_stream(self.h2d_stream)
            self.value_home.index_fill_(0, seg.chunk_slots, -1)
            self.kv.give_back(pages)
        return len(pages)

    # ---- accounting ----------------------------------------------------------------------------
    def segment_bytes(self, seg: Segment, num_chunks: int | None = None) -> dict[str, int]:
        """GPU bytes (its pages, or the share of num_chunks of its chunks: a view of it, with its
        whole basis and outliers) and host bytes of a segment."""
        n = seg.num_chunks if num_chunks is None else num_chunks
        page = self.kv.bytes_per_token * self.chunk_size
        slots = -(-n // self.layout.slots_per_page) * page
        outliers = seg.num_outliers * page
        basis = self.basis_pages_per_segment * page
        host = self.num_layers * n * self.chunk_size * self.num_kv_heads * self.head_dim * self.host_elt
        return {"gpu_slot_page_bytes": slots, "gpu_outlier_bytes": outliers, "gpu_basis_bytes": basis,
                "gpu_compressed_bytes": slots + outliers + basis, "host_bytes": host}

    def held_pages(self) -> list[int]:
        """Pages of the dense pool that hold compressed state: the null page and every live segment's."""
        return [self.null_page, *(p for seg in self.live.values() for p in seg.pages + seg.value_pages)]

    def capacity_bytes(self) -> dict[str, int]:
        live = [self.segment_bytes(seg) for seg in self.live.values()]
        on_gpu = [b for b, seg in zip(live, self.live.values()) if not seg.parked]
        return {"host_pool_bytes": sum(t.numel() * t.element_size() for t in self.host_v), "segments": len(live),
                "segment_gpu_bytes": sum(b["gpu_compressed_bytes"] for b in on_gpu),
                "parked_segment_pages": sum(len(seg.host_pages) for seg in self.parked_segments()),
                "segment_host_bytes": sum(b["host_bytes"] for b in live),
                "segment_pages": sum(len(seg.pages) for seg in self.live.values()),
                "gpu_value_pages": sum(len(seg.value_pages) for seg in self.live.values()),
                "gpu_value_segments": sum(bool(seg.value_pages) for seg in self.live.values()),
                "chunk_slots": self.chunk_capacity, "free_chunk_slots": self.free_chunks,
                "free_segments": self.free_segments, "slots_per_page": self.layout.slots_per_page,
                **({} if self.copies is None else {
                    "exact_copy_bytes": self.copies.nbytes(), "exact_copy_chunks": self.copies.capacity,
                    "free_exact_copy_chunks": self.copies.free_chunks,
                    "exact_copy_segments": len(self.copies.holders())})}


def _storage_dtype(name: str, requested: torch.dtype | None, dtype: torch.dtype) -> torch.dtype:
    """The pool dtype (None) or int8; anything else is an error naming the argument."""
    if requested not in (None, dtype, torch.int8):
        raise ValueError(f"{name} must be the pool dtype or torch.int8, got {requested}")
    return requested or dtype
