"""The cache's compressed tier: ShadowKV's state as radix-cache payload (DESIGN.md §3). Only the
CacheManager calls it.

Compression is a tier of the cache, not a step of every prefill. Policy "tier" (the default): a
prompt stays dense and is served exactly as full attention serves it; when memory runs short the
Demoter (demotion.py) turns the least recently used long dense spans of the tree into compressed
segments, and eviction drops compressed state last. A long prompt is compressed at its prefill
only when it could never be held dense: the long documents asked for at once (running and
waiting, counted once per document) exceed EAGER_SHARE of the pool's pages that the compressed
state requests use does not hold (in_use_pages). Why not of the whole pool: with 48 chat sessions
over their own 16K documents (SGLang's client on the H100), once the queue shrank the last 14
documents were prefilled dense into the pages lent for the running sessions' GPU values, 29 of
them were given back, and the last turns decoded from host memory at 2.7 ms a row instead of HBM.
Policy "eager" compresses every long prompt at its prefill (the previous behaviour).

A request's page entries (see Req.pages) may be compressed ChunkRefs matched from the tree; its
suffix prefills against them without restoring them dense (shadowkv/suffix_prefill.py). A prompt
compressed at its prefill gets its own segment during the step that completes it; then its span's
dense pages are replaced by ChunkRefs, and decode runs the sparse path over every compressed chunk.

Pages: segments, and the chunk-cache scratch rows of requests that decode compressed, take their
pages from the one dense pool (admission counts both). `droppable_pages` counts the pages of
segments that only unlocked tree entries reference (evicting those frees them), so admission can
count them as available beside the dense evictable pages.

GPU values: a compressed segment also keeps its values in pages the pool lends
(ShadowKVPool.load_values) when it is compressed or matched, if the pages not promised to running
requests stay above the demotion watermark after: decoding over it then reads them from HBM, not
over PCIe. Lent pages count as free; an allocation that needs them takes back those of the least
recently used segments, segments no request reads first, and the host copy serves those from then on.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Callable

from sglang_shadowkv.mem_cache.compressed_pool import ChunkRef, ParkedChunkRef, Segment
from sglang_shadowkv.mem_cache.radix_cache import PrefixMatch, RadixCache, TreeNode
from sglang_shadowkv.model_executor.model_runner import ModelRunner
from sglang_shadowkv.shadowkv.memory_report import request_report
from sglang_shadowkv.shadowkv.request_state import CompressedLayout, ShadowKVReqState, build_layout

from .counters import CompressionCounters
from .demotion import Demoter, watermark_pages
from .request import Req
from .tier_choice import Rates

logger = logging.getLogger(__name__)

EAGER_SHARE = 0.8  # policy "tier": compress at prefill when long documents at once exceed this share of the pool


@dataclass
class AdmissionPlan:
    """What ShadowKV needs to admit a request: its own span compressed at prefill, if any, whether
    it starts over compressed chunks, and the pages both take at admission (its segment's and its
    chunk-cache scratch row's)."""
    start: int  # first token past the matched prefix
    own_span: int  # tokens of its prompt compressed at its prefill (0: none)
    matched_chunks: bool
    extra_pages: int  # pages the own segment and the scratch row take


class CompressedTier:
    def __init__(self, runner: ModelRunner, tree: RadixCache, page_size: int, headroom: Callable[[], int],
                 rates: Rates, to_host: Callable[[TreeNode], bool] | None):
        """headroom: unused pages of the pool that no running request is promised (CacheManager.headroom);
        rates: what the scheduler measures (the demoter's cost rule); to_host: the host tier's move of
        a dense node (CacheManager.move_to_host; None without a host tier)."""
        self.cfg, self.store, self.decoder = runner.shadowkv_config, runner.compressed_pool, runner.decoder
        self.runner, self.pool, self.tree, self.page_size = runner, runner.pool, tree, page_size
        if page_size != self.cfg.chunk_size:
            raise ValueError(f"attention='shadowkv' needs page_size == shadowkv_chunk_size "
                             f"(got {page_size} and {self.cfg.chunk_size})")
        self.counters = CompressionCounters()
        self.rank_totals = [0] * runner.config.num_layers  # summed over compressions: the mean rank per layer
        self.last_ranks: list[int] = []
        self._unsettled: list[tuple[Segment, str]] = []  # compressed, ranks not read yet (settle_ranks)
        self.droppable_pages = 0
        self.policy = self.cfg.compress_policy  # the warmup sets "eager" for a moment
        self.headroom, self.rates, self.to_host = headroom, rates, to_host
        self.demoter = Demoter(self) if self.policy == "tier" else None
        # questions prefill over their document's exact copy loaded dense where the pool can spare
        # the pages (the warmup turns this off for a while: the suffix prefill's kernels compile)
        self.copies_loaded_dense = True
        self._uses = itertools.count(1)
        self.pool.reclaim = self._give_back_values

    # ---- entries and their accounting ----------------------------------------------------------
    def release_entries(self, entries: list) -> int:
        """Give back page entries: dense pages to the pool, chunk references to their segments.
        Returns the pages freed."""
        dense = [e for e in entries if isinstance(e, int)]
        self.pool.free(dense)
        refs = [e for e in entries if isinstance(e, ChunkRef)]
        freed = self.store.release_chunks(refs)
        for seg in {id(r.segment): r.segment for r in refs}.values():
            self._refresh(seg)
        return len(dense) + freed

    def new_refs(self, seg: Segment) -> list[ChunkRef]:
        refs = self.store.chunk_refs(seg)
        self._refresh(seg)
        return refs

    def on_evictable(self, entries: list, sign: int) -> None:
        """The tree's hook: these entries became evictable (+1) or stopped being so (-1)."""
        refs = [e for e in entries if isinstance(e, ChunkRef)]
        for seg, group in itertools.groupby(refs, key=lambda r: r.segment):
            seg.unlocked_tree_refs += sign * sum(1 for _ in group)
            self._refresh(seg)

    def _refresh(self, seg: Segment) -> None:
        droppable = seg.refs > 0 and seg.refs == seg.unlocked_tree_refs
        if droppable != seg.droppable:
            self.droppable_pages += len(seg.pages) if droppable else -len(seg.pages)
            seg.droppable = droppable

    def in_use_pages(self) -> int:
        """Dense-pool pages the compressed state in use holds: the segments some request reads or
        is compressing (with their GPU values) and the scratch rows of running requests. Segments
        only the cache holds are not counted: they can be dropped."""
        in_use = [seg for seg in self.store.live.values() if not seg.droppable]
        return (sum(len(seg.pages) + len(seg.value_pages) for seg in in_use) + self.decoder.taken_row_pages
                + self.store.copy_loads.num_pages)

    def check_capacity(self, prompt_len: int) -> None:
        span = self.cfg.compressed_len(prompt_len, self.page_size)
        capacity = self.store.chunk_capacity * self.cfg.chunk_size
        if span > capacity:
            raise ValueError(f"prompt compresses to {span} tokens but the ShadowKV host pool holds "
                             f"{capacity}; raise shadowkv_host_tokens or shadowkv_host_mem_fraction")

    # ---- admission ----------------------------------------------------------------------------
    def trim_match(self, match: PrefixMatch) -> PrefixMatch:
        """A match shorter than min_context loses its compressed part and what follows it. A prompt
        that shares only a document's first tokens (a chat template's header) would otherwise
        prefill all of its own tokens as a suffix over that document's compressed chunks and
        decode through the sparse path: on the H100, eight 32K prompts sharing 33 tokens of one
        compressed document decoded at 32.5 ms a step (full attention: 15.3 ms on an H200). Those
        few tokens cost almost nothing to prefill again, exactly."""
        if len(match.pages) * self.page_size >= self.cfg.min_context:
            return match  # (checked first: a long match's entries are not walked on every admission)
        first = next((i for i, e in enumerate(match.pages) if isinstance(e, ChunkRef)), None)
        if first is None:
            return match
        node, depth = match.node, len(match.pages)
        while depth > first:  # up to the node whose path ends before the first compressed page
            depth -= len(node.pages)
            node = node.parent
        return PrefixMatch(match.pages[:depth], node)

    def plan(self, req: Req, entries: list, long_demand: int) -> AdmissionPlan | None:
        """What admitting req with the matched entries takes (None: it stays plain dense).
        long_demand: tokens of the long documents asked for at once (see the module docstring)."""
        matched_chunks = any(isinstance(e, ChunkRef) for e in entries)
        start = len(entries) * self.page_size
        own = self.cfg.compressed_len(len(req.input_ids) - start, self.page_size)
        if own and self.policy == "tier" and \
                long_demand <= EAGER_SHARE * (self.pool.capacity - self.in_use_pages()) * self.page_size:
            own = 0  # it can be held dense: compressed later only if memory runs short
        if not matched_chunks and not own:
            return None
        chunks = own // self.cfg.chunk_size
        segment = self.store.pages_for(chunks, self.cfg.num_outliers(chunks)) if own else 0
        return AdmissionPlan(start, own, matched_chunks, segment + self.decoder.row_pages)

    def admit(self, req: Req, plan: AdmissionPlan, entries: list) -> ShadowKVReqState | None:
        """Take the plan's segment and a scratch row with its pages (None, nothing taken, when
        either is short: the request waits). A suffix over matched chunks attends them exactly when
        it is long, or when the request scores its prompt (logprobs); over their exact copies when
        they have them (its own segment's copy is never taken from them): loaded into dense pages
        (load_prefix_copy), else gathered into the suffix prefill's workspace."""
        seg = None
        layout = build_layout(entries, self.cfg.chunk_size) if plan.matched_chunks else None
        if plan.own_span:
            chunks = plan.own_span // self.cfg.chunk_size
            self.free_value_slots(chunks)
            seg = self.store.alloc_segment(plan.start, plan.own_span, self.cfg.num_outliers(chunks),
                                           keep_copies=layout.segments if layout else ())
            if seg is None:
                return None
        row = self.decoder.alloc_row()
        if row is None:
            if seg is not None:
                self.store.free_segment(seg)
            return None
        state = ShadowKVReqState(row, seg)
        if layout is not None:
            state.layout = layout
            suffix = len(req.input_ids) - plan.start
            state.exact_prefill = suffix > self.cfg.sparse_prefill_max or (
                req.logprob is not None and not req.logprob.input_done)
            self.counters.compressed_prefix_hits += 1
            if state.exact_prefill and self.store.has_copies(layout.segments):
                self.counters.exact_copy_hits += 1
            self.counters.compressed_tokens_reused += state.layout.num_chunks * self.cfg.chunk_size
        return state

    def load_prefix_copy(self, req: Req) -> None:
        """An admitted request (its reservation counted, its prefix's GPU values placed) whose
        prefill attends every chunk of a prefix with exact copies has that copy loaded into dense
        pages (shared with the requests prefilling over the same one), when the pool's unused pages
        beside every promise stay above the demotion watermark after: a temporary load must neither
        evict cached documents nor start a demotion (else the workspace reads the copy)."""
        st = req.shadowkv
        if not (self.copies_loaded_dense and st.exact_prefill and self.store.has_copies(st.layout.segments)):
            return
        if self.store.copy_loads.pages_needed(st.layout) > self.headroom() - watermark_pages(self.pool):
            return
        self.counters.dense_copy_prefills += 1
        st.copy_load = self.store.copy_loads.acquire(req.pages, st.layout)

    # ---- prompt done --------------------------------------------------------------------------
    def free_value_slots(self, chunks: int) -> None:
        """Make `chunks` host value slots free for a new segment: drop parked segments, least
        recently used first, then compressed documents on the GPU that no request reads. Without
        it a full host value pool turned requests away ("the ShadowKV pools are full") while the
        cache held documents it could drop. (The second step is the tree's eviction for chunk
        entries, which lets dense frontier nodes go first: the short suffixes below documents.)"""
        while self.store.free_chunks < chunks and self.tree.evict_host(1, only=lambda e: type(e) is ParkedChunkRef):
            pass
        if self.store.free_chunks < chunks:
            self.tree.evict(0, num_chunks=chunks - self.store.free_chunks)

    def on_prompt_done(self, req: Req) -> None:
        """After the step that completed the prompt (and compressed the own span, if any)."""
        st = req.shadowkv
        st.compress_now = False
        self._release_copy_load(st)
        if st.segment is None:  # its prompt's own tokens stay dense: the matched layout holds
            return
        self.store.wait_host_writes()  # the next step's value gathers read them
        self._swap_in_chunk_refs(req, st.segment)
        self.counters.compressed_requests += 1
        st.segment = None
        st.layout = build_layout(req.pages, self.cfg.chunk_size)

    def _release_copy_load(self, st: ShadowKVReqState) -> None:
        """Its prompt no longer reads the dense pages of its prefix's copy: decode reads the
        compressed form, whose values take the pages a load gave back if they could not before
        (the loads of a step's questions came before some of their documents' values)."""
        if st.copy_load is not None:
            self.store.copy_loads.release(st.copy_load)
            st.copy_load = None
            for seg in st.layout.segments:
                self._gpu_values(seg)

    def _swap_in_chunk_refs(self, req: Req, seg: Segment) -> None:
        """The segment is compressed: its span's dense pages are freed, ChunkRefs take their place."""
        first = seg.start // self.page_size
        refs = self.new_refs(seg)
        self.pool.free(req.pages[first:first + len(refs)])
        req.pages[first:first + len(refs)] = refs
        self.count_compression(seg, f"of request {req.rid}")

    def count_compression(self, seg: Segment, what: str) -> None:
        """Count a finished compression; its ranks are read later (settle_ranks): reading them now,
        right after the step that compresses was launched, would wait for that whole step."""
        self._use(seg)
        self.counters.compressions += 1
        self.counters.compressed_tokens += seg.num_tokens
        self._unsettled.append((seg, what))

    def settle_ranks(self, wait: bool) -> None:
        """Book the ranks of finished compressions into the rank statistics (and the log): those
        already on the host, or (wait) all of them."""
        while self._unsettled and (wait or self._unsettled[0][0].ranks_ready()):
            seg, what = self._unsettled.pop(0)
            ranks = seg.settle_ranks()
            self.rank_totals = [t + r for t, r in zip(self.rank_totals, ranks)]
            self.last_ranks = list(ranks)
            logger.info("ShadowKV: compressed %d tokens %s, ranks per layer %s", seg.num_tokens, what, ranks)

    # ---- GPU values ----------------------------------------------------------------------------
    def use_matched(self, layout: CompressedLayout) -> None:
        """An admitted request (its pages reserved) matched these compressed chunks: their segments were used."""
        for seg in layout.segments:
            self._use(seg)

    def _use(self, seg: Segment) -> None:
        """A segment was compressed or matched: most recently used, its values onto the GPU."""
        seg.last_use = next(self._uses)
        self._gpu_values(seg)

    def _gpu_values(self, seg: Segment) -> None:
        """Its values onto the GPU if the pool can spare the pages and stay above the demotion watermark."""
        if seg.value_pages or self.cfg.disable_gpu_values:
            return
        room = self.headroom() - watermark_pages(self.pool)
        if self.store.value_pages_for(seg.num_chunks) <= room and self.store.load_values(seg):
            self.counters.gpu_value_loads += 1

    def _give_back_values(self, pages: int) -> None:
        """The pool's reclaim hook: give back at least `pages` lent pages, from the segments no
        request reads, least recently used first."""
        held = [seg for seg in self.store.live.values() if seg.value_pages]
        for seg in sorted(held, key=lambda s: (s.refs > s.unlocked_tree_refs, s.last_use)):
            if pages <= 0:
                return
            pages -= self.store.drop_values(seg)
            self.counters.gpu_value_drops += 1

    # ---- release ------------------------------------------------------------------------------
    def before_release(self, req: Req) -> None:
        """Report, free what only the request used, and (policy eager) compress a long own dense
        tail (policy tier leaves that to the Demoter, once it is cold)."""
        st = req.shadowkv
        self._release_copy_load(st)  # aborted before its prompt was done
        if st.layout is not None:
            req.shadowkv_info = self.report(req)
        if st.segment is not None:  # aborted before its prompt was compressed
            self.store.free_segment(st.segment)
            st.segment = None
        self.decoder.free_row(st.scratch_row)
        if self.demoter is None and req.prompt_done and req.finish_reason.get("type") != "abort":
            self._compress_tail(req)

    def _compress_tail(self, req: Req) -> None:
        ps = self.page_size
        layout = req.shadowkv.layout  # every compressed chunk of its pages
        first = max(req.num_borrowed, 0 if layout is None else layout.compressed_end // ps)
        whole = req.num_computed // ps
        span = self.cfg.compressed_len((whole - first) * ps, ps)
        if span <= 0:
            return
        seg = self.store.alloc_segment(first * ps, span, self.cfg.num_outliers(span // ps))
        if seg is None:
            logger.info("no room to compress request %s's dense tail: it stays dense", req.rid)
            return
        self.runner.backend.compress_span(req.pool_row, seg)
        self.store.wait_host_writes()
        self._swap_in_chunk_refs(req, seg)
        self.counters.tail_compressions += 1

    # ---- numbers ------------------------------------------------------------------------------
    def report(self, req: Req) -> dict:
        dense_tokens = sum(isinstance(e, int) for e in req.pages) * self.page_size
        return request_report(self.store, self.decoder, req.shadowkv.layout, req.shadowkv.scratch_row,
                              dense_tokens, self.pool.bytes_per_token, req.num_computed)
