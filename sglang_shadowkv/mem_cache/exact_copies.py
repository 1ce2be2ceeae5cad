"""Exact copies of compressed documents' keys and values in host memory, for the prefill of
questions on them.

Why: a question sent cold prefills over its document's exact keys and values and compresses the
document after; the same question on the document cached compressed prefilled over keys rebuilt
from their low-rank factors and (on a GPU) int8 values. The two computed the question's own keys
and values differently, and long greedy answers parted at near ties (docs/accuracy.md#ruler).
With a copy, a question's every-chunk prefill reads the document's keys and values as cold
attended them: loaded into dense pages (copy_loads.py), or gathered into the suffix prefill's
workspace (shadowkv/suffix_prefill.py). Decode never reads a copy: cold decodes over the
compressed form too.

Copies are a cache within a fixed host budget (`shadowkv_exact_copy_fraction`): a compression
that finds too little room takes it from the copies of the least recently used segments, and a
question on a document whose copy went prefills over its compressed form, as without copies.
The store is laid out as the host value pool ([slots + 1, Hkv, c, D] per layer, slot 0 unused),
so the value gather kernel moves copies too; `slot_of[chunk slot]` names a chunk's copy. Values
are copied only when the host pool does not already hold them exactly (int8 there).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Iterable

import torch

from .host_memory import PinnedHostTensor, contiguous_runs
from .kv_pool import to_device

if TYPE_CHECKING:
    from .compressed_pool import Segment


class ExactCopies:
    def __init__(self, num_layers: int, num_kv_heads: int, chunk_size: int, head_dim: int, dtype: torch.dtype,
                 chunks: int, with_values: bool, num_slots: int, device: torch.device):
        shape = (chunks + 1, num_kv_heads, chunk_size, head_dim)
        pinned = device.type == "cuda"  # read by the gather kernel over PCIe (UVA)

        def store() -> list[torch.Tensor]:
            if not pinned:
                return [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
            owners = [PinnedHostTensor(shape, dtype) for _ in range(num_layers)]
            self._owners.extend(owners)
            return [owner.tensor for owner in owners]

        self._owners: list[PinnedHostTensor] = []
        self.k = store()
        self.v = store() if with_values else None  # None: the host value pool holds them exactly
        self.slot_of = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.device = device
        self._free = list(range(chunks, 0, -1))
        self._holders: dict[int, Segment] = {}  # segments with a copy, by id
        self._pins: Counter[int] = Counter()  # segments whose copy a load reads (copy_loads.py), by id

    @property
    def capacity(self) -> int:
        """Chunks the store holds."""
        return len(self.k[0]) - 1

    @property
    def free_chunks(self) -> int:
        return len(self._free)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def holders(self) -> list[Segment]:
        return list(self._holders.values())

    def take(self, seg: Segment, keep: Iterable[Segment] = ()) -> bool:
        """Copy slots for a new segment, taken from the least recently used copies when short
        (never those of `keep`, nor pinned ones); False, nothing taken, when the store cannot hold it."""
        n = seg.num_chunks
        kept = {s.seg_id for s in keep} | set(self._pins)
        spare = sum(s.num_chunks for s in self._holders.values() if s.seg_id not in kept)
        if n > len(self._free) + spare:
            return False
        # least recently used first; a segment still being compressed (never used yet: 0) last
        for victim in sorted(self._holders.values(), key=lambda s: s.last_use or float("inf")):
            if len(self._free) >= n:
                break
            if victim.seg_id not in kept:
                self.drop(victim)
        seg.copy_slots = [self._free.pop() for _ in range(n)]
        seg.copy_runs = contiguous_runs(seg.copy_slots)
        self._holders[seg.seg_id] = seg
        return True

    def place(self, seg: Segment) -> None:
        """Name the segment's copies for its chunk slots (0: none), wherever it now lives."""
        if seg.copy_slots:
            self.slot_of[seg.chunk_slots] = to_device(torch.tensor(seg.copy_slots, dtype=torch.int32), self.device)
        else:
            self.slot_of.index_fill_(0, seg.chunk_slots, 0)

    def pin(self, segments: Iterable[Segment]) -> None:
        """Keep these segments' copies from new segments while a load reads them (copy_loads.py)."""
        self._pins.update(seg.seg_id for seg in segments)

    def unpin(self, segments: Iterable[Segment]) -> None:
        """A load that pinned these segments' copies is done."""
        self._pins.subtract(seg.seg_id for seg in segments)
        self._pins = +self._pins  # (drops the zero counts)

    def drop(self, seg: Segment) -> None:
        """Give a segment's copy slots back (it is read compressed from now on)."""
        if not seg.copy_slots:
            return
        if not seg.parked:  # a parked segment's chunk slots may be another's by now
            self.slot_of.index_fill_(0, seg.chunk_slots, 0)
        self._free.extend(reversed(seg.copy_slots))
        seg.copy_slots, seg.copy_runs = [], []
        del self._holders[seg.seg_id]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + (self.v or []))
