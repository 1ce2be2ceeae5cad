"""Demotion: long dense documents in the radix cache leave the GPU dense form, off the critical
path, for the tier the cost rule picks (scheduler/tier_choice.py), instead of being dropped.

Under pressure: when the pool's headroom (free pages not promised to running requests) falls under
a watermark, or a waiting request needs more than the headroom, the least recently used unlocked
dense span of at least shadowkv_min_context tokens leaves the GPU: to the host tier at once when
the rule says a reload costs less, else compressed (its most recent local_window tokens stay
dense, as at a prefill compression). Without pressure, a dense span that running decode rows read
is compressed when the rule says sparse decode pays (judged every DECODE_PAYS_EVERY steps).

A compression is a job: it locks the span, takes its segment's pages and compresses it a few
layers per scheduler step, reading the dense pages' K/V, on a side stream on a GPU, so a decode
step waits on it for a few milliseconds at most; when a waiting request cannot start until the
job frees its pages, the job does all its layers at once. When every layer is done and no request
reads the span dense, its tree entries become the segment's chunks and its dense pages go back to
the pool. A request that matched the span meanwhile keeps reading it dense and the swap waits for
it, except in a job for decode rows: those rows are switched to sparse decode over the segment
then (each takes a chunk-cache scratch row), and only readers that cannot be switched yet (still
prefilling, or no scratch row) make it wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from sglang_shadowkv.mem_cache.compressed_pool import Segment
from sglang_shadowkv.mem_cache.radix_cache import TreeNode
from sglang_shadowkv.shadowkv.request_state import ShadowKVReqState, build_layout

from .counters import DemotionCounters
from .request import Req
from .tier_choice import COMPRESSED_DECODE_PAYS, COMPRESSED_NO_ROOM, TO_HOST, decode_pays, leave_gpu, remaining_steps

if TYPE_CHECKING:
    from sglang_shadowkv.layers.attention.shadowkv_backend import SpanCompression

HEADROOM_SHARE = 0.1  # keep this share of the pool free (or promised to nobody) ahead of need
TOKEN_LAYERS_PER_STEP = 32768  # demotion work per step: e.g. 2 layers of a 16K-token document
PATIENCE_STEPS = 64  # a finished job whose span stays in use this long gives up (its segment is freed)
DECODE_PAYS_EVERY = 16  # steps between two looks for dense documents that decode rows would read cheaper sparse


def watermark_pages(pool) -> int:
    """The headroom kept ahead of need: HEADROOM_SHARE of the pool."""
    return int(HEADROOM_SHARE * pool.capacity)


@dataclass
class DemotionJob:
    node: TreeNode  # the span's lowest node (locked by the job; splits leave it the lowest)
    start: int  # position of the span's first token
    pages: list[int]  # the span's dense pages, in token order
    segment: Segment
    reason: str  # why it is compressed (a tier_choice reason)
    compression: "SpanCompression | None" = None  # started with the first layer
    layer: int = 0  # next layer to compress
    waited: int = 0  # steps spent finished but waiting for the span to be free
    done: torch.cuda.Event | None = None

    @property
    def num_tokens(self) -> int:
        return self.segment.num_tokens


class Tier(Protocol):
    """What a demotion needs of the compressed tier (scheduler/compressed_tier.py): the tree,
    pools and settings it works on, the model runner's backend that compresses and its decoder
    (scratch rows), the measured rates, the host tier's move (None: no host tier; False: it cannot
    take the node) and three calls."""
    tree: Any
    pool: Any
    store: Any
    cfg: Any
    page_size: int
    runner: Any
    decoder: Any
    rates: Any
    to_host: Callable[[TreeNode], bool] | None

    def headroom(self) -> int: ...

    def new_refs(self, seg: Segment) -> list: ...

    def count_compression(self, seg: Segment, what: str) -> None: ...


class Demoter:
    def __init__(self, tier: Tier):
        self.tier, self.tree, self.pool, self.store = tier, tier.tree, tier.pool, tier.store
        self.cfg, self.page_size = tier.cfg, tier.page_size
        self.job: DemotionJob | None = None
        self.counters = DemotionCounters()
        self.steps = 0  # scheduler steps seen (the decode-pays look's cadence: the same on every rank)
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
    def step(self, available_pages: int, waiting_need: int, idle: bool, running: list[Req]) -> None:
        """Advance the demotion by this step's share of work. With none under way: when memory is
        short, documents leave the dense tier (to the host, or a job starts); else, every
        DECODE_PAYS_EVERY steps, a job starts on a document decode rows would read cheaper sparse.
        All of the job's work goes in one step when nothing decodes, or when the next waiting
        request needs more than the headroom (its first token waits on this demotion, so a few
        steps of decode run slower instead of that request waiting many steps).
        available_pages: free + evictable - reserved."""
        self.steps += 1
        if self.job is None and self.wanted(waiting_need):
            self._relieve(available_pages, waiting_need, _sparse_rows(running))
        elif self.job is None and self.steps % DECODE_PAYS_EVERY == 0:
            self._compress_where_decode_pays(running)
        job = self.job
        if job is None:
            return
        urgent = idle or waiting_need > self.tier.headroom()
        budget = TOKEN_LAYERS_PER_STEP
        while job.layer < self.store.num_layers and (urgent or budget > 0):
            self._compress_layer(job)
            budget -= job.num_tokens
        if job.layer == self.store.num_layers:
            self._finish(job, running)

    def _relieve(self, available_pages: int, waiting_need: int, sparse_rows: int) -> None:
        """Memory is short: the least recently used long dense documents leave the GPU, each where
        the cost rule sends it (sparse_rows: running rows that decode sparse), until it is not (a
        move to the host frees its pages at once) or a compression job starts."""
        rates = None  # rank 0's, gathered once (a collective under tensor parallelism)
        while self.job is None and self.wanted(waiting_need):
            found = self._candidate(available_pages)
            if found is None:
                return
            node, span = found
            if rates is None:
                rates = self.tier.rates.agreed(self.tier.runner.tp)
            host = self.tier.runner.host_pool
            displaced = 0 if host is None else max(0, host.shortfall(node.pages)) * self.page_size
            reason = leave_gpu(len(node.key), rates, self.tier.to_host is not None, sparse_rows, displaced)
            if reason == TO_HOST and self.tier.to_host(node):
                self._count(TO_HOST)
            elif not self._start(node, span, COMPRESSED_NO_ROOM if reason == TO_HOST else reason):
                return

    def _segment_pages(self, span: int, reclaimable_chunks: int) -> tuple[int, bool]:
        """(pool pages a segment of `span` tokens takes, whether the compressed pool can take it,
        counting reclaimable_chunks more host value slots: parked segments', which _start frees
        when it needs them)."""
        chunks = span // self.page_size
        outliers = self.cfg.num_outliers(chunks)
        return self.store.pages_for(chunks, outliers), self.store.can_alloc(chunks, outliers, reclaimable_chunks)

    def _span(self, node: TreeNode) -> int:
        """Tokens of an all-dense node to compress (0: none, or not all dense)."""
        if not all(isinstance(e, int) for e in node.pages):
            return 0
        return self.cfg.compressed_len(len(node.key), self.page_size)

    def _candidate(self, available_pages: int) -> tuple[TreeNode, int] | None:
        """(node, tokens of it to compress) of the least recently used unlocked all-dense node long
        enough to compress, whose lock and segment the available pages allow."""
        best, reclaimable = None, self.store.parked_chunks
        for node in self.tree.nodes():
            if node.lock_ref or (best is not None and node.last_access >= best[0].last_access):
                continue
            span = self._span(node)
            if span <= 0:
                continue
            pages, fits = self._segment_pages(span, reclaimable)
            if pages + span // self.page_size <= available_pages and fits:
                best = (node, span)
        return best

    def _compress_where_decode_pays(self, running: list[Req]) -> None:
        """Start a job on the dense document whose decode rows save the most reading it sparse, if
        that pays (tier_choice.decode_pays) and the headroom above the watermark holds its segment
        and the rows' scratch."""
        rows = [r for r in running if r.prompt_done and r.shadowkv is None]
        found = []  # (node, span, its rows)
        for node in self.tree.nodes() if rows else ():
            span = self._span(node) if node.lock_ref else 0  # (a node no request locks has no reader)
            if span:
                first = self.tree.node_start(node) // self.page_size
                readers = [r for r in rows if _shared(r.pages, first, node.pages[:1])]
                found += [(node, span, readers)] if readers else []
        if not found:
            return
        rates = self.tier.rates.agreed(self.tier.runner.tp)
        room = self.tier.headroom() - watermark_pages(self.pool)
        found = [(node, span, [remaining_steps(r, rates) for r in readers]) for node, span, readers in found]
        reclaimable = self.store.parked_chunks
        sparse_rows = _sparse_rows(running)
        for node, span, steps in sorted(found, key=lambda f: -f[1] * sum(f[2])):
            pages, fits = self._segment_pages(span, reclaimable)
            if (fits and pages + len(steps) * self.tier.decoder.row_pages <= room
                    and decode_pays(span, steps, rates, sparse_rows)
                    and self._start(node, span, COMPRESSED_DECODE_PAYS)):
                return

    def _start(self, node: TreeNode, span: int, reason: str) -> bool:
        """Lock the span (its first `span` tokens: the recent tail stays dense) and take its
        segment; False, nothing taken, when the compressed pool cannot."""
        if span < len(node.key):
            node = self.tree.split(node, span)  # the upper part: its recent tail stays dense
        self.tier.free_value_slots(span // self.page_size)
        segment = self.store.alloc_segment(self.tree.node_start(node), span, self.cfg.num_outliers(span // self.page_size))
        if segment is None:
            return False
        self.tree.lock(node)
        self.job = DemotionJob(node, segment.start, list(node.pages), segment, reason)
        return True

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

    def _finish(self, job: DemotionJob, running: list[Req]) -> None:
        """Swap the span's dense entries for the segment's chunks once no request reads them dense:
        a job for decode rows first switches its readers to sparse decode, when all of them can be."""
        first = job.start // self.page_size
        readers = [(r, n) for r in running if (n := _shared(r.pages, first, job.pages))]
        new_rows = sum(r.shadowkv is None for r, _ in readers)
        switch = (job.reason == COMPRESSED_DECODE_PAYS and all(r.prompt_done for r, _ in readers)
                  and new_rows <= self.tier.decoder.free_rows
                  and new_rows * self.tier.decoder.row_pages <= self.tier.headroom())
        if readers and not switch:  # a request reads it dense: wait for it
            job.waited += 1
            if job.waited > PATIENCE_STEPS:
                self.cancel()
            return
        if job.done is not None:  # the dense pages are reused on the main stream: after the reads
            torch.cuda.current_stream(self.pool.device).wait_event(job.done)
        self.store.wait_host_writes()
        refs, at = self.tier.new_refs(job.segment), 0
        for node in self._span_nodes(job):
            self.tree.release(self.tree.replace_entries(node, refs[at:at + len(node.pages)]))
            at += len(node.pages)
        for req, shared in readers:
            self._read_sparse(req, first, refs[:shared])
        self.tree.unlock(job.node)
        self.job = None
        self.tier.count_compression(job.segment, f"demoted at position {job.start} ({job.reason}; "
                                                 f"{len(readers)} running requests read it sparse from now on)")
        self._count(job.reason)
        self.counters.demotions += 1
        self.counters.demoted_tokens += job.num_tokens
        self.counters.rows_made_sparse += len(readers)

    def _read_sparse(self, req: Req, first: int, refs: list) -> None:
        """A running request reads the tree's chunks from page `first` on in place of its dense
        pages, through a scratch row (taken now if it has none) and the layout built anew."""
        req.pages[first:first + len(refs)] = refs
        if req.shadowkv is None:
            req.shadowkv = ShadowKVReqState(self.tier.decoder.alloc_row())
        req.shadowkv.layout = build_layout(req.pages, self.cfg.chunk_size)

    def _count(self, reason: str) -> None:
        setattr(self.counters, reason, getattr(self.counters, reason) + 1)

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


def _shared(pages: list, first: int, span: list) -> int:
    """How many of a span's leading dense pages a request's pages hold from page `first` on (a
    request reading it holds the tree's pages: all of them, or the part its prompt matched)."""
    n = 0
    for mine, its in zip(pages[first:first + len(span)], span):
        if mine != its:
            break
        n += 1
    return n


def _sparse_rows(running: list[Req]) -> int:
    """Running requests that decode sparse (over a compressed prefix)."""
    return sum(1 for r in running if r.prompt_done and r.over_compressed_prefix)
