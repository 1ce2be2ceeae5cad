"""Demotion: cold dense documents in the radix cache become compressed segments, off the
critical path, instead of being dropped when memory runs short (compression as a cache tier).

When the pool's headroom (free pages not promised to running requests) falls under a watermark,
or a waiting request needs more than the headroom, the least recently used unlocked dense span of
at least shadowkv_min_context tokens is chosen (its most recent local_window tokens stay dense, as
at a prefill compression). A job locks it, takes its segment's pages and compresses it a few
layers per scheduler step, reading the dense pages' K/V, on a side stream on a GPU, so a decode
step waits on it for a few milliseconds at most; when a waiting request cannot start until the
job frees its pages, the job does all its layers at once. When every layer is done and no request holds
the span, its tree entries become the segment's chunks and its dense pages go back to the pool; a
request that matched the span meanwhile keeps reading it dense, and the swap waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sglang_shadowkv.mem_cache.compressed_pool import Segment
from sglang_shadowkv.mem_cache.radix_cache import TreeNode

from .counters import DemotionCounters

if TYPE_CHECKING:
    from sglang_shadowkv.layers.attention.shadowkv_backend import SpanCompression

HEADROOM_SHARE = 0.1  # keep this share of the pool free (or promised to nobody) ahead of need
TOKEN_LAYERS_PER_STEP = 32768  # demotion work per step: e.g. 2 layers of a 16K-token document
PATIENCE_STEPS = 64  # a finished job whose span stays in use this long gives up (its segment is freed)


def watermark_pages(pool) -> int:
    """The headroom kept ahead of need: HEADROOM_SHARE of the pool."""
    return int(HEADROOM_SHARE * pool.capacity)


@dataclass
class DemotionJob:
    node: TreeNode  # the span's lowest node (locked by the job; splits leave it the lowest)
    start: int  # position of the span's first token
    pages: list[int]  # the span's dense pages, in token order
    segment: Segment
    compression: "SpanCompression | None" = None  # started with the first layer
    layer: int = 0  # next layer to compress
    waited: int = 0  # steps spent finished but waiting for the span to be free
    done: torch.cuda.Event | None = None

    @property
    def num_tokens(self) -> int:
        return self.segment.num_tokens


class Tier(Protocol):
    """What a demotion needs of the compressed tier (scheduler/compressed_tier.py): the tree,
    pools and settings it works on, the model runner's backend that compresses, and three calls."""
    tree: Any
    pool: Any
    store: Any
    cfg: Any
    page_size: int
    runner: Any

    def headroom(self) -> int: ...

    def new_refs(self, seg: Segment) -> list: ...

    def count_compression(self, seg: Segment, what: str) -> None: ...


class Demoter:
    def __init__(self, tier: Tier):
        self.tier, self.tree, self.pool, self.store = tier, tier.tree, tier.pool, tier.store
        self.cfg, self.page_size = tier.cfg, tier.page_size
        self.job: DemotionJob | None = None
        self.counters = DemotionCounters()
        self.stream = torch.cuda.Stream(self.pool.device) if self.pool.device.type == "cuda" else None

    def segments(self) -> list[Segment]:
        return [] if self.job is None else [self.job.segment]

    # ---- when ----------------------------------------------------------------------------------
    def wanted(self, waiting_need: int) -> bool:
        """Whether memory is short: the headroom (CacheManager.headroom: pages lent for GPU values
        do not count, so a dense document is demoted before compressed ones lose their GPU values)
        under the watermark, or under what the next waiting request needs."""
        return self.tier.headroom() < max(watermark_pages(self.pool), waiting_need)

    def can_help(self, available_pages: int) -> bool:
        """Whether waiting for a demotion can free pages (a job runs, or one can start)."""
        return self.job is not None or self._candidate(available_pages) is not None

    # ---- work ----------------------------------------------------------------------------------
    def step(self, available_pages: int, waiting_need: int, idle: bool) -> None:
        """Advance the demotion by this step's share of work; start a job when memory is short.
        All of the job's work goes in one step when nothing decodes, or when the next waiting
        request needs more than the headroom (its first token waits on this demotion, so a few
        steps of decode run slower instead of that request waiting many steps).
        available_pages: free + evictable - reserved."""
        if self.job is None and self.wanted(waiting_need):
            self._start(available_pages)
        job = self.job
        if job is None:
            return
        urgent = idle or waiting_need > self.tier.headroom()
        budget = TOKEN_LAYERS_PER_STEP
        while job.layer < self.store.num_layers and (urgent or budget > 0):
            self._compress_layer(job)
            budget -= job.num_tokens
        if job.layer == self.store.num_layers:
            self._finish(job)

    def _candidate(self, available_pages: int) -> tuple[TreeNode, int, int] | None:
        """(node, tokens of it to compress, pages that takes) of the least recently used unlocked
        all-dense node long enough to compress, whose lock and segment the available pages allow."""
        best = None
        for node in self.tree.nodes():
            if node.lock_ref or (best is not None and node.last_access >= best[0].last_access):
                continue
            if not all(isinstance(e, int) for e in node.pages):
                continue
            span = self.cfg.compressed_len(len(node.key), self.page_size)
            if span <= 0:
                continue
            chunks = span // self.page_size
            outliers = self.cfg.num_outliers(chunks)
            pages = self.store.pages_for(chunks, outliers)
            if pages + chunks <= available_pages and self.store.can_alloc(chunks, outliers):
                best = (node, span, pages)
        return best

    def _start(self, available_pages: int) -> None:
        found = self._candidate(available_pages)
        if found is None:
            return
        node, span, _ = found
        if span < len(node.key):
            node = self.tree.split(node, span)  # the upper part: its recent tail stays dense
        segment = self.store.alloc_segment(self.tree.node_start(node), span, self.cfg.num_outliers(span // self.page_size))
        if segment is None:
            return
        self.tree.lock(node)
        self.job = DemotionJob(node, segment.start, list(node.pages), segment)

    def _compress_layer(self, job: DemotionJob) -> None:
        if self.stream is None:
            self._compress_layer_here(job)
        else:  # the job's buffers are made on the side stream too: freed there, reused after its work
            self.stream.wait_stream(torch.cuda.current_stream(self.pool.device))
            with torch.cuda.stream(self.stream):
                self._compress_layer_here(job)
            job.done = torch.cuda.Event()
            job.done.record(self.stream)
        job.layer += 1

    def _compress_layer_here(self, job: DemotionJob) -> None:
        backend = self.tier.runner.backend
        if job.compression is None:
            job.compression = backend.start_compression(backend.page_slots(job.pages, job.segment), job.segment)
        backend.continue_compression(job.compression, job.layer)

    def _finish(self, job: DemotionJob) -> None:
        """Swap the span's dense entries for the segment's chunks once no request holds it."""
        nodes = self._span_nodes(job)
        if any(n.lock_ref > 1 for n in nodes):  # a request reads it dense: wait for it
            job.waited += 1
            if job.waited > PATIENCE_STEPS:
                self.cancel()
            return
        if job.done is not None:  # the dense pages are reused on the main stream: after the reads
            torch.cuda.current_stream(self.pool.device).wait_event(job.done)
        self.store.wait_host_writes()
        refs, at = self.tier.new_refs(job.segment), 0
        for node in nodes:
            old = self.tree.replace_entries(node, refs[at:at + len(node.pages)])
            at += len(node.pages)
            self.pool.free(old)
        self.tree.unlock(job.node)
        self.job = None
        self.tier.count_compression(job.segment, f"demoted at position {job.start}")
        self.counters.demotions += 1
        self.counters.demoted_tokens += job.num_tokens

    def _span_nodes(self, job: DemotionJob) -> list[TreeNode]:
        """The nodes covering the job's span, top first (splits since the start made more)."""
        nodes, node, covered = [], job.node, 0
        while covered < job.num_tokens:
            nodes.append(node)
            covered += len(node.key)
            node = node.parent
        return nodes[::-1]

    def cancel(self) -> None:
        """Give up the running job: its segment is freed, its span stays dense."""
        job, self.job = self.job, None
        if job is None:
            return
        if job.done is not None:
            torch.cuda.current_stream(self.pool.device).wait_event(job.done)
        self.store.wait_host_writes()
        self.store.free_segment(job.segment)
        self.tree.unlock(job.node)
        self.counters.demotions_abandoned += 1
