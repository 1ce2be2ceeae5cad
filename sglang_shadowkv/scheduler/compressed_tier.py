"""The cache's compressed tier: ShadowKV's state as radix-cache payload (DESIGN.md §3). Only the
CacheManager calls it.

A request's page entries (see Req.pages) may be compressed ChunkRefs matched from the tree; its
suffix prefills against them without restoring them dense (shadowkv/suffix_prefill.py), sparsely
for a short suffix and exactly (streamed) for a long one. A long unmatched prompt gets its own
segment, compressed during the step that completes the prompt; then the own span's dense pages
are replaced by ChunkRefs, and decode runs the sparse path over every compressed chunk of the
prefix. When the request finishes, a long dense tail (a chat that grew) is compressed into a
new segment, and all entries go to the tree, so the next turn reuses them.
"""

from __future__ import annotations

import dataclasses
import logging

from sglang_shadowkv.mem_cache.radix_cache import RadixCache
from sglang_shadowkv.mem_cache.compressed_pool import ChunkRef, Segment
from sglang_shadowkv.shadowkv.memory_report import request_report
from sglang_shadowkv.shadowkv.request_state import ShadowKVReqState, build_layout

from sglang_shadowkv.model_executor.model_runner import ModelRunner

from .counters import CompressionCounters
from .request import Req

logger = logging.getLogger(__name__)


class CompressedTier:
    def __init__(self, runner: ModelRunner, tree: RadixCache, page_size: int):
        self.cfg, self.store, self.decoder = runner.shadowkv_config, runner.compressed_pool, runner.decoder
        self.runner, self.pool, self.tree, self.page_size = runner, runner.pool, tree, page_size
        if page_size != self.cfg.chunk_size:
            raise ValueError(f"attention='shadowkv' needs page_size == shadowkv_chunk_size "
                             f"(got {page_size} and {self.cfg.chunk_size})")
        self.counters = CompressionCounters()
        self.rank_totals = [0] * runner.config.num_layers  # summed over compressions: the mean rank per layer
        self.last_ranks: list[int] = []

    # ---- entries ------------------------------------------------------------------------------
    def release_entries(self, entries: list) -> None:
        """Give back page entries: dense pages to the pool, chunk references to their segments."""
        self.pool.free([e for e in entries if isinstance(e, int)])
        self.store.release_chunks([e for e in entries if isinstance(e, ChunkRef)])

    def check_capacity(self, prompt_len: int) -> None:
        span = self.cfg.compressed_len(prompt_len, self.page_size)
        capacity = self.store.chunk_capacity * self.cfg.chunk_size
        if span > capacity:
            raise ValueError(f"prompt compresses to {span} tokens but the ShadowKV pools hold "
                             f"{capacity}; raise shadowkv_host_tokens")

    def _alloc_segment(self, start: int, span: int) -> Segment | None:
        """A segment for span tokens from start, evicting compressed tree leaves if the pools are full."""
        outliers = self.cfg.num_outliers(span // self.cfg.chunk_size)
        seg = self.store.alloc_segment(start, span, outliers)
        if seg is None and self.tree.evictable_chunks:
            self.tree.evict(0, span // self.cfg.chunk_size)
            seg = self.store.alloc_segment(start, span, outliers)
        return seg

    # ---- admission ----------------------------------------------------------------------------
    def plan(self, req: Req, entries: list) -> ShadowKVReqState | None | bool:
        """ShadowKV state for a request about to be admitted with the matched entries: None when
        it stays plain dense, False when the pools are full (wait). A suffix over matched chunks
        attends them exactly when it is long, or when the request scores its prompt (logprobs)."""
        matched_chunks = any(isinstance(e, ChunkRef) for e in entries)
        start = len(entries) * self.page_size
        own = self.cfg.compressed_len(len(req.input_ids) - start, self.page_size)
        if not matched_chunks and not own:
            return None
        seg = self._alloc_segment(start, own) if own else None
        row = self.decoder.alloc_row() if (seg is not None or not own) else None
        if row is None:
            if seg is not None:
                self.store.free_segment(seg)
            return False
        state = ShadowKVReqState(row, seg)
        if matched_chunks:
            state.layout = build_layout(entries, self.cfg.chunk_size)
            suffix = len(req.input_ids) - start
            state.exact_prefill = suffix > self.cfg.sparse_prefill_max or (
                req.logprob is not None and not req.logprob.input_done)
            self.counters.compressed_prefix_hits += 1
            self.counters.compressed_tokens_reused += state.layout.num_chunks * self.cfg.chunk_size
        return state

    # ---- prompt done --------------------------------------------------------------------------
    def on_prompt_done(self, req: Req) -> None:
        """After the step that completed the prompt (and compressed the own span, if any)."""
        st = req.shadowkv
        if st.segment is not None:
            self.store.wait_host_writes()  # the next step's value gathers read them
            self._swap_in_chunk_refs(req, st.segment)
            self.counters.compressed_requests += 1
            st.segment = None
        st.compress_now = False
        st.layout = build_layout(req.pages, self.cfg.chunk_size)

    def _swap_in_chunk_refs(self, req: Req, seg: Segment) -> None:
        """The segment is compressed: its span's dense pages are freed, ChunkRefs take their place."""
        first = seg.start // self.page_size
        refs = self.store.chunk_refs(seg)
        self.pool.free(req.pages[first:first + len(refs)])
        req.pages[first:first + len(refs)] = refs
        self.counters.compressions += 1
        self.counters.compressed_tokens += seg.num_tokens
        self.rank_totals = [t + r for t, r in zip(self.rank_totals, seg.ranks)]
        self.last_ranks = list(seg.ranks)
        logger.info("ShadowKV: compressed %d tokens of request %s, ranks per layer %s", seg.num_tokens, req.rid,
                    seg.ranks)

    # ---- release ------------------------------------------------------------------------------
    def before_release(self, req: Req) -> None:
        """Report, free what only the request used, and compress a long own dense tail."""
        st = req.shadowkv
        if st.layout is not None:
            req.shadowkv_info = self.report(req)
        if st.segment is not None:  # aborted before its prompt was compressed
            self.store.free_segment(st.segment)
            st.segment = None
        self.decoder.free_row(st.scratch_row)
        if req.prompt_done and req.finish_reason.get("type") != "abort":
            self._compress_tail(req)

    def _compress_tail(self, req: Req) -> None:
        ps = self.page_size
        last_chunk = max((i for i, e in enumerate(req.pages) if isinstance(e, ChunkRef)), default=-1)
        first = max(req.num_borrowed, last_chunk + 1)
        whole = req.num_computed // ps
        span = self.cfg.compressed_len((whole - first) * ps, ps)
        if span <= 0:
            return
        seg = self._alloc_segment(first * ps, span)
        if seg is None:
            logger.info("ShadowKV pools full: request %s's dense tail stays dense", req.rid)
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

    def holders(self) -> dict:
        """Who holds the compressed state, so that a leak shows: once idle, every segment, chunk
        slot (one slot of each pool, host values included) and chunk reference is free or the
        radix tree's, and every scratch row is free."""
        in_tree = {id(e.segment): e.segment for e in self.tree.entries() if isinstance(e, ChunkRef)}
        return {"segments": self.store.max_segments, "free_segments": self.store.free_segments,
                "tree_segments": len(in_tree),
                "chunk_slots": self.store.chunk_capacity, "free_chunk_slots": self.store.free_chunks,
                "tree_chunk_slots": sum(seg.num_chunks for seg in in_tree.values()),
                "chunk_refs": sum(seg.refs for seg in self.store.live.values()),
                "tree_chunk_refs": self.tree.total_chunks,
                "scratch_rows": self.decoder.max_rows, "free_scratch_rows": self.decoder.free_rows}

    def server_stats(self, running: list[Req]) -> dict:
        """Totals over running requests with a compressed prefix, the cache's compressed state,
        pool capacity, and the cumulative counters."""
        live = [r for r in running if r.shadowkv is not None and r.shadowkv.layout is not None]
        reports = [self.report(r) for r in live]
        total = {key: sum(r[key] for r in reports) for key in
                 ("dense_kv_bytes", "gpu_compressed_bytes", "gpu_scratch_bytes", "gpu_total_bytes",
                  "host_bytes", "full_kv_bytes", "chunk_cache_hits", "chunk_cache_lookups")}
        total["gpu_saving_vs_full"] = total["full_kv_bytes"] / total["gpu_total_bytes"] if reports else 0.0
        total["chunk_cache_hit_rate"] = (total["chunk_cache_hits"] / total["chunk_cache_lookups"]
                                         if total["chunk_cache_lookups"] else 0.0)
        done = max(1, self.counters.compressions)
        return {"config": dataclasses.asdict(self.cfg), "running_compressed_requests": len(reports),
                "ranks": {"last_per_layer": self.last_ranks,
                          "mean_per_layer": [round(t / done, 2) for t in self.rank_totals]},
                "budget": self.decoder.budget_stats(),
                "running_total": total, "per_request": {r.rid: rep for r, rep in zip(live, reports)},
                "pools": self.store.capacity_bytes(), "holders": self.holders(),
                "radix_cache": {"compressed_tokens": self.tree.total_chunks * self.cfg.chunk_size,
                                "evictable_compressed_tokens": self.tree.evictable_chunks * self.cfg.chunk_size},
                **self.counters.as_dict()}
