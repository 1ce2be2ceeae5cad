"""Exact copies loaded into dense pages, so that a question on a compressed document prefills as it
would cold.

Why: the same question sent cold prefills the document and itself densely, then compresses the
document. On the document cached compressed, its prefill attended the document's exact copy from a
workspace (shadowkv/suffix_prefill.py): the same keys and values, but two attentions merged by
log-sum-exp, whose rounding alone parted a third of long greedy answers in bfloat16 (RULER,
docs/accuracy.md). Loaded into pages of the dense pool, the document is read by the dense kernel,
exactly as a dense prefix hit of full attention is, whose answers are full attention's token for
token (ruler.py's full_hit). The request decodes over the compressed form, as cold does, and the
pages go back when its prompt is done.

A load is shared by the requests whose prefixes hold the same chunks (a segment's chunks have
fixed positions; a burst of questions on one document loads it once). It is taken only when the pool can spare its
pages above the demotion watermark; otherwise the question prefills over the workspace, as before.
The load is queued at admission, and its segments' copies are pinned while it lives (no new
segment takes their slots: none writes them while the load may still read them). On a GPU a load
runs on a stream of its own, layer by layer, and a step's layer waits for that layer's pages only
(kv_pool.LayerLoads): PCIe overlaps the first layers' compute.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .kv_pool import LayerLoads, to_device

if TYPE_CHECKING:
    from sglang_shadowkv.shadowkv.request_state import CompressedLayout

    from .compressed_pool import Segment, ShadowKVPool


@dataclass(eq=False)
class CopyLoad:
    """One document's exact copy in dense pages: a page per compressed chunk of the prefix, in order."""
    key: tuple  # its prefix's CompressedLayout.chunks_key: which chunks of which segments (each at its place)
    pages: list[int]
    segments: list[Segment]  # whose copies it reads: pinned (ExactCopies.pin) while it lives
    users: int = 1

    def table_pages(self, entries: list) -> list[int]:
        """The prefix's page entries with each compressed chunk's loaded page in its place."""
        loaded = iter(self.pages)
        return [e if type(e) is int else next(loaded) for e in entries]


def chunk_runs(entries: list) -> list[tuple[Segment, int, int]]:
    """(segment, first chunk, count) of each run of consecutive chunks of one segment among page
    entries (page ids and ChunkRefs), in order."""
    runs = []
    for e in entries:
        if type(e) is int:
            continue
        seg, first, count = runs[-1] if runs else (None, 0, 0)
        if seg is e.segment and first + count == e.index:  # the run goes on
            runs[-1] = (seg, first, count + 1)
        else:
            runs.append((e.segment, e.index, 1))
    return runs


class CopyLoads:
    def __init__(self, store: ShadowKVPool):
        self.store, self.kv = store, store.kv
        self.live: dict[tuple, CopyLoad] = {}
        cuda = self.kv.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.kv.device) if cuda else None
        self._layer_ready = LayerLoads(self.kv)

    def pages_needed(self, layout: CompressedLayout) -> int:
        """Dense pages a load of a prefix's compressed chunks takes (0: loaded already, to be shared)."""
        return 0 if layout.chunks_key in self.live else layout.num_chunks

    def acquire(self, entries: list, layout: CompressedLayout) -> CopyLoad:
        """The compressed chunks of a prefix's page entries (their segments all have exact copies;
        `layout` is theirs) in dense pages: a load another request holds, or a new one queued now
        (its pages counted beforehand: pages_needed)."""
        load = self.live.get(layout.chunks_key)
        if load is not None:
            load.users += 1
            return load
        load = CopyLoad(layout.chunks_key, self.kv.alloc(layout.num_chunks), list(layout.segments))
        self.live[load.key] = load
        self.store.copies.pin(load.segments)
        self._queue(chunk_runs(entries), load.pages)
        return load

    def release(self, load: CopyLoad) -> None:
        """A request's prefill over the load is done (or aborted): the last one frees its pages."""
        load.users -= 1
        if load.users == 0:
            del self.live[load.key]
            self.kv.free(load.pages)
            self.store.copies.unpin(load.segments)

    def held_pages(self) -> list[int]:
        return [p for load in self.live.values() for p in load.pages]

    @property
    def num_pages(self) -> int:
        return sum(len(load.pages) for load in self.live.values())

    def _queue(self, runs: list[tuple[Segment, int, int]], pages: list[int]) -> None:
        """Every layer's keys and values of the runs' chunks into the pages (token-major, as the
        pool holds them), after the work queued on the compute stream (the pages' last readers);
        a ready event per layer on a GPU."""
        kv, c = self.kv, self.kv.page_size
        dst = to_device(torch.tensor(pages, dtype=torch.int64), kv.device)
        firsts = itertools.accumulate((count for _, _, count in runs), initial=0)  # each run's first page
        spans = [(seg, first, count, at) for (seg, first, count), at in zip(runs, firsts)]
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(kv.device))
            dst.record_stream(stream)
        events = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for layer, buffers in enumerate(zip(kv.k_buffers, kv.v_buffers)):
                for seg, first, count, at in spans:
                    for side, chunks in enumerate(self.store.read_exact_copy(layer, seg, first, count)):
                        # [count, Hkv, c, D] chunk-major into [page, c, Hkv, D] pages
                        buffers[side].view(-1, c, *buffers[side].shape[1:])[dst[at:at + count]] = \
                            chunks.transpose(1, 2).to(buffers[side].dtype)
                if stream is not None:
                    events.append(torch.cuda.Event())
                    events[-1].record(stream)
        self._layer_ready.loaded(events)
