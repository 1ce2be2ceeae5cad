"""The compressed-segment store: GPU pools of low-rank keys, landmarks and outliers, host values.

A segment is a chunk-aligned span of one prompt compressed with one basis per layer. Its state is
addressed by *chunk slot* so that every pool is indexed the same way and kernels serve a whole
batch with one launch: chunk slot s owns the low-rank rows a_rows[s*c : s*c+c] (GPU), the
landmark landmarks[s] and per KV head whether it can be selected (selectable[s], 0 for
outlier chunks, which are always attended instead) (GPU), the values host_v[s] = [Hkv, c, D] (pinned host memory; one chunk
of one head is one contiguous read) and the metadata chunk_pos[s] (position of its first token)
and chunk_basis[s] (the segment's basis id). Outlier chunks are copied per KV head into a GPU
outlier pool of [c, D] blocks. Slot 0 of every pool is reserved as a padding target.

Host values may be int8 with one float32 scale per chunk and KV head (value_scale[s], GPU): the
host pool and the bytes a decode step gathers over PCIe shrink to one per value (half of bf16),
for a rounding error of at most half a step of 1/127 of the chunk's largest value. Landmarks may
be int8 the same way (landmark_scale[s]): half their GPU memory, which at long contexts is a third
of a request's, and half the bytes the per-step scores read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .host_memory import PinnedHostTensor


@dataclass
class Segment:
    seg_id: int  # basis id
    start: int  # position of the first token
    num_tokens: int
    chunk_slots: torch.Tensor  # [n] int64 on the pool's device, in token order
    outlier_blocks: torch.Tensor  # [Hkv, outliers] int32 blocks of every layer's outlier pool
    ranks: list[int] = field(default_factory=list)  # per layer, filled by compression
    slot_runs: list[tuple[int, int, int]] = field(default_factory=list)  # (first slot, count, chunk offset)
    refs: int = 0  # live ChunkRefs (radix tree entries and running requests'); freed at 0

    @property
    def num_chunks(self) -> int:
        return self.chunk_slots.numel()

    @property
    def num_outliers(self) -> int:
        """Outlier chunks per KV head."""
        return self.outlier_blocks.shape[1]


@dataclass(eq=False)
class ChunkRef:
    """Tokens of one page held compressed: chunk `index` of `segment` (page size = chunk size).
    The radix tree and requests keep these in place of dense page ids."""
    segment: Segment
    index: int


class ShadowKVPool:
    def __init__(self, num_chunk_slots: int, max_segments: int, max_outliers: int, chunk_size: int,
                 num_layers: int, num_kv_heads: int, head_dim: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device | str, value_dtype: torch.dtype | None = None,
                 landmark_dtype: torch.dtype | None = None):
        self.chunk_size, self.num_kv_heads, self.head_dim = chunk_size, num_kv_heads, head_dim
        self.max_rank, self.dtype, self.device = max_rank, dtype, torch.device(device)
        self.num_layers = num_layers
        self.max_outliers = max_outliers
        slots = num_chunk_slots + 1
        out_blocks = max_segments * num_kv_heads * max_outliers + 1
        kv_dim = num_kv_heads * head_dim
        pin = self.device.type == "cuda"
        gpu = dict(dtype=dtype, device=self.device)
        self.a_rows = [torch.zeros(slots * chunk_size, max_rank, **gpu) for _ in range(num_layers)]
        self.basis = [torch.zeros(max_segments, max_rank, kv_dim, **gpu) for _ in range(num_layers)]
        # each basis's rank (<= max_rank): key rebuilds read only that many low-rank columns
        self.basis_rank = [torch.zeros(max_segments, dtype=torch.int32, device=self.device) for _ in range(num_layers)]
        landmark_dtype = _storage_dtype("landmark_dtype", landmark_dtype, dtype)
        self.landmarks = [torch.zeros(slots, num_kv_heads, head_dim, dtype=landmark_dtype, device=self.device)
                          for _ in range(num_layers)]
        self.landmark_scale = _scales(slots, num_kv_heads, self.device, num_layers, landmark_dtype)
        self.selectable = [torch.zeros(slots, num_kv_heads, dtype=torch.int8, device=self.device)
                           for _ in range(num_layers)]
        self.outlier_k = [torch.zeros(out_blocks, chunk_size, head_dim, **gpu) for _ in range(num_layers)]
        self.outlier_v = [torch.zeros(out_blocks, chunk_size, head_dim, **gpu) for _ in range(num_layers)]
        # position of each outlier block's first token (outliers differ per layer)
        self.outlier_pos = [torch.zeros(out_blocks, dtype=torch.int32, device=self.device)
                            for _ in range(num_layers)]
        host_shape = (slots, num_kv_heads, chunk_size, head_dim)
        host_dtype = _storage_dtype("value_dtype", value_dtype, dtype)
        if pin:  # page-locked at the exact size; unpinned when the pool (its owners) goes
            self._host_owners = [PinnedHostTensor(host_shape, host_dtype) for _ in range(num_layers)]
            self.host_v = [owner.tensor for owner in self._host_owners]
        else:
            self._host_owners = []
            self.host_v = [torch.zeros(host_shape, dtype=host_dtype) for _ in range(num_layers)]
        self.value_scale = _scales(slots, num_kv_heads, self.device, num_layers, host_dtype)
        self.chunk_pos = torch.zeros(slots, dtype=torch.int32, device=self.device)
        self.chunk_basis = torch.zeros(slots, dtype=torch.int32, device=self.device)
        self._free_slots = list(range(slots - 1, 0, -1))
        self.max_segments = max_segments
        self._free_segments = list(range(max_segments - 1, -1, -1))
        self._free_out_blocks = list(range(out_blocks - 1, 0, -1))
        self.elt = torch.empty((), dtype=dtype).element_size()
        self.host_elt = self.host_v[0].element_size()
        self.d2h_stream = torch.cuda.Stream(self.device) if pin else None
        self.live: dict[int, Segment] = {}  # allocated segments by id

    @property
    def chunk_capacity(self) -> int:
        return len(self.a_rows[0]) // self.chunk_size - 1

    @property
    def free_chunks(self) -> int:
        return len(self._free_slots)

    @property
    def free_segments(self) -> int:
        return len(self._free_segments)

    @property
    def outlier_capacity(self) -> int:
        """Outlier blocks that can ever be allocated (all but the reserved block 0)."""
        return self.outlier_k[0].shape[0] - 1

    def free_ids(self) -> dict[str, list[int]]:
        """Free segment ids, chunk slots and outlier blocks (copies; for accounting checks)."""
        return {"segments": list(self._free_segments), "chunk_slots": list(self._free_slots),
                "outlier_blocks": list(self._free_out_blocks)}

    def can_alloc(self, num_chunks: int, num_outliers: int) -> bool:
        return (num_chunks <= len(self._free_slots) and self._free_segments
                and self.num_kv_heads * num_outliers <= len(self._free_out_blocks))

    def alloc_segment(self, start: int, num_tokens: int, num_outliers: int) -> Segment | None:
        """Reserve the slots of a segment (None, nothing taken, when the pools are full)."""
        n = num_tokens // self.chunk_size
        if num_tokens % self.chunk_size or not self.can_alloc(n, num_outliers):
            return None
        slots = [self._free_slots.pop() for _ in range(n)]
        blocks = [self._free_out_blocks.pop() for _ in range(self.num_kv_heads * num_outliers)]
        seg = Segment(self._free_segments.pop(), start, num_tokens,
                      torch.tensor(slots, dtype=torch.int64, device=self.device),
                      torch.tensor(blocks, dtype=torch.int32, device=self.device).view(-1, num_outliers),
                      ranks=[0] * self.num_layers, slot_runs=_contiguous_runs(slots))
        self.chunk_pos[seg.chunk_slots] = (start + torch.arange(n, device=self.device) * self.chunk_size).int()
        self.chunk_basis[seg.chunk_slots] = seg.seg_id
        self.live[seg.seg_id] = seg
        return seg

    def chunk_refs(self, seg: Segment) -> list[ChunkRef]:
        """One reference per chunk of a compressed segment; the segment lives while any does."""
        seg.refs += seg.num_chunks
        return [ChunkRef(seg, i) for i in range(seg.num_chunks)]

    def release_chunks(self, refs: list[ChunkRef]) -> None:
        for ref in refs:
            ref.segment.refs -= 1
            if ref.segment.refs == 0:
                self.free_segment(ref.segment)
            elif ref.segment.refs < 0:
                raise RuntimeError("ShadowKV pool: a chunk reference was released twice")

    def free_segment(self, seg: Segment) -> None:
        del self.live[seg.seg_id]
        self._free_slots.extend(seg.chunk_slots.tolist()[::-1])
        self._free_out_blocks.extend(seg.outlier_blocks.flatten().tolist()[::-1])
        self._free_segments.append(seg.seg_id)

    def write_host_values(self, layer: int, seg: Segment, values: torch.Tensor) -> None:
        """Copy the segment's values [n, Hkv, c, D] into its host chunks: one copy per run of
        consecutive slots. On the GPU the copies go on a side stream straight into pinned memory,
        so they overlap the next layers' prefill; `wait_host_writes` orders later readers."""
        if self.value_scale is not None:
            values, scale = quantize_per_head(values)
            self.value_scale[layer][seg.chunk_slots] = scale

        def copy_runs(non_blocking: bool):
            for first, count, offset in seg.slot_runs:
                self.host_v[layer][first:first + count].copy_(values[offset:offset + count],
                                                              non_blocking=non_blocking)

        if self.d2h_stream is None or not values.is_cuda:
            copy_runs(False)
            return
        self.d2h_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h_stream):
            copy_runs(True)
        values.record_stream(self.d2h_stream)

    def read_host_values(self, layer: int, seg: Segment, first: int, count: int) -> torch.Tensor:
        """Values [count, Hkv, c, D] of chunks first..first+count-1 of a segment, on the pool's
        device: one copy per run of consecutive slots, straight from pinned memory."""
        parts = []
        for slot, run, offset in seg.slot_runs:
            lo, hi = max(first, offset), min(first + count, offset + run)
            if lo < hi:
                parts.append(self.host_v[layer][slot + lo - offset:slot + hi - offset].to(
                    self.device, non_blocking=True))
        values = torch.cat(parts) if len(parts) > 1 else parts[0]
        if self.value_scale is None:
            return values
        scale = self.value_scale[layer][seg.chunk_slots[first:first + count]]
        return (values.float() * scale[:, :, None, None]).to(self.dtype)

    def write_landmarks(self, layer: int, seg: Segment, landmarks: torch.Tensor) -> None:
        """Store the segment's landmarks [n, Hkv, D] (an int8 pool quantises them with their scales)."""
        if self.landmark_scale is not None:
            landmarks, scale = quantize_per_head(landmarks)
            self.landmark_scale[layer][seg.chunk_slots] = scale
        self.landmarks[layer][seg.chunk_slots] = landmarks.to(self.landmarks[layer].dtype)

    def wait_host_writes(self) -> None:
        """Make the current stream wait for the value copies of finished compressions."""
        if self.d2h_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.d2h_stream)

    def token_rows(self, seg: Segment) -> torch.Tensor:
        """a_rows indices of the segment's tokens, in token order."""
        c = self.chunk_size
        return (seg.chunk_slots[:, None] * c + torch.arange(c, device=self.device)).flatten()

    # ---- accounting ----------------------------------------------------------------------------
    def segment_bytes(self, seg: Segment, num_chunks: int | None = None) -> dict[str, int]:
        """GPU bytes (low-rank rows and bases at their true ranks, landmarks, outliers) and host bytes
        of a segment, or of num_chunks of its chunks (a view of it, with its whole basis)."""
        kv_dim, c = self.num_kv_heads * self.head_dim, self.chunk_size
        n = seg.num_chunks if num_chunks is None else num_chunks
        layers = len(seg.ranks)
        lowrank = sum(r * (n * c + kv_dim) for r in seg.ranks) * self.elt
        landmarks = layers * n * (kv_dim * self.landmarks[0].element_size()
                                  + (0 if self.landmark_scale is None else self.num_kv_heads * 4))
        outliers = layers * 2 * self.num_kv_heads * seg.num_outliers * c * self.head_dim * self.elt
        scales = 0 if self.value_scale is None else layers * n * self.num_kv_heads * 4
        host = layers * n * c * kv_dim * self.host_elt
        return {"gpu_lowrank_bytes": lowrank, "gpu_landmark_bytes": landmarks,
                "gpu_outlier_bytes": outliers, "gpu_value_scale_bytes": scales,
                "gpu_compressed_bytes": lowrank + landmarks + outliers + scales, "host_bytes": host}

    @staticmethod
    def bytes_per_unit(num_layers: int, num_kv_heads: int, head_dim: int, chunk_size: int, max_rank: int,
                       max_outliers: int, dtype: torch.dtype, value_dtype: torch.dtype | None,
                       landmark_dtype: torch.dtype | None) -> dict[str, int]:
        """What one chunk slot costs on the GPU and on the host, and one segment on the GPU (its
        bases and outlier blocks): the allocation above, per unit, for sizing the pools."""
        elt = torch.empty((), dtype=dtype).element_size()
        value_elt = torch.empty((), dtype=value_dtype or dtype).element_size()
        landmark_elt = torch.empty((), dtype=landmark_dtype or dtype).element_size()
        scales = 4 * num_kv_heads * ((value_dtype == torch.int8) + (landmark_dtype == torch.int8))
        kv_dim = num_kv_heads * head_dim
        gpu_slot = num_layers * (chunk_size * max_rank * elt + kv_dim * landmark_elt + num_kv_heads + scales) + 8
        host_slot = num_layers * chunk_size * kv_dim * value_elt
        segment = num_layers * (max_rank * kv_dim * elt + num_kv_heads * max_outliers * (2 * chunk_size * head_dim * elt + 4))
        return {"gpu_per_slot": gpu_slot, "host_per_slot": host_slot, "gpu_per_segment": segment}

    def capacity_bytes(self) -> dict[str, int]:
        def total(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)
        gpu = total(self.a_rows + self.basis + self.landmarks + self.outlier_k + self.outlier_v
                    + (self.value_scale or []) + (self.landmark_scale or []))
        live = [self.segment_bytes(seg) for seg in self.live.values()]
        return {"gpu_pool_bytes": gpu, "host_pool_bytes": total(self.host_v), "segments": len(live),
                "segment_gpu_bytes": sum(b["gpu_compressed_bytes"] for b in live),
                "segment_host_bytes": sum(b["host_bytes"] for b in live),
                "chunk_slots": self.chunk_capacity, "free_chunk_slots": self.free_chunks,
                "free_segments": self.free_segments}


def quantize_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, Hkv, ...] (values of chunks, or landmarks) -> int8 and the float32 scale [n, Hkv] of each
    chunk and KV head (its largest magnitude / 127; x = int8 * scale)."""
    x = x.float()
    scale = x.flatten(2).abs().amax(2).clamp(min=1e-30) / 127
    per_element = scale.view(*scale.shape, *[1] * (x.dim() - 2))
    return (x / per_element).round().clamp(-127, 127).to(torch.int8), scale


def _storage_dtype(name: str, requested: torch.dtype | None, dtype: torch.dtype) -> torch.dtype:
    """The pool dtype (None) or int8; anything else is an error naming the argument."""
    if requested not in (None, dtype, torch.int8):
        raise ValueError(f"{name} must be the pool dtype or torch.int8, got {requested}")
    return requested or dtype


def _scales(slots: int, num_kv_heads: int, device: torch.device, num_layers: int,
            dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Per layer a float32 scale per chunk slot and KV head for an int8 pool (None otherwise)."""
    if dtype != torch.int8:
        return None
    return [torch.ones(slots, num_kv_heads, dtype=torch.float32, device=device) for _ in range(num_layers)]


def _contiguous_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, count, offset in the list) of each run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    for offset, slot in enumerate(slots):
        if runs and runs[-1][0] + runs[-1][1] == slot:
            first, count, start = runs[-1]
            runs[-1] = (first, count + 1, start)
        else:
            runs.append((slot, 1, offset))
    return runs
