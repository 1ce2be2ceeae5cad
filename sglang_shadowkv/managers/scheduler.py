"""Continuous batching with chunked prefill over a paged pool and a radix prefix cache.

Each step mixes the running requests' decode tokens with prompt chunks (at most
chunked_prefill_size prompt tokens per step) into one forward pass. A request is admitted only
when the pool, counting what the radix cache could evict, can hold its prompt plus its full
max_new_tokens: once running it never waits for memory and is never preempted. A finished or
aborted request leaves its whole pages in the radix cache for later requests to reuse.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from dataclasses import dataclass

import torch

from sglang_shadowkv.layers.sampler import SamplingRow, sample
from sglang_shadowkv.mem_cache.kv_pool import PoolExhaustedError
from sglang_shadowkv.mem_cache.radix_cache import RadixCache
from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.server_args import ServerArgs
from sglang_shadowkv.shadowkv.memory_report import request_report
from sglang_shadowkv.shadowkv.request_state import ShadowReqState

from .model_runner import ModelRunner, StepItem
from .request import Req

logger = logging.getLogger(__name__)

FREED_PAGE = 0  # marks a page of req.pages given back after compression (page 0 is never allocated)


@dataclass
class ReqUpdate:
    """What one step did for one request: the tokens it produced and, at the end, why it stopped."""
    req: Req
    new_ids: list[int]
    finished: bool


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunner | None = None):
        self.args = args
        self.runner = runner or ModelRunner(args)
        self.pool = self.runner.pool
        self.tokenizer = self.runner.tokenizer
        self.page_size = args.page_size
        self.context_length = self.runner.context_length
        self.tree = RadixCache(self.page_size, self.pool.free)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reserved_pages = 0
        self.eos_ids = set(self.runner.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.vocab_size = self.runner.config.vocab_size
        self.sampling_device = self.runner.device
        self.default_generator = torch.Generator(device=self.sampling_device).manual_seed(args.random_seed)
        self.stats = {"prefill_tokens": 0, "cached_tokens": 0, "decode_tokens": 0, "requests": 0,
                      "compressed_requests": 0, "compressed_tokens": 0}
        self.shadow_cfg, self.shadow_pool = self.runner.shadow_cfg, self.runner.shadow_pool

    # ---- submission ---------------------------------------------------------------------------
    def add_request(self, rid: str, input_ids: list[int], sampling: SamplingParams,
                    return_logprob: bool = False) -> Req:
        """Validate and queue; raises ValueError naming the problem (nothing is allocated then)."""
        if not input_ids:
            raise ValueError("prompt is empty: give a non-empty text or input_ids")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
               for t in input_ids):
            raise ValueError(f"input_ids must be ints in [0, {self.vocab_size})")
        if len(input_ids) >= self.context_length:
            raise ValueError(f"prompt has {len(input_ids)} tokens; the context length is "
                             f"{self.context_length} (prompt plus at least one new token must fit)")
        if any(r.rid == rid for r in self.running) or any(r.rid == rid for r in self.waiting):
            raise ValueError(f"rid {rid!r} is already in use")
        max_total_len = min(len(input_ids) + sampling.max_new_tokens, self.context_length)
        if self._pages_for(max_total_len) > self.pool.capacity:
            raise ValueError(
                f"prompt plus max_new_tokens needs {max_total_len} KV tokens but the pool holds "
                f"{self.pool.capacity * self.page_size}; lower max_new_tokens or raise max_total_tokens")
        self._check_shadowkv_capacity(len(input_ids))
        gen = None
        if sampling.sampling_seed is not None:
            gen = torch.Generator(device=self.sampling_device).manual_seed(sampling.sampling_seed)
        req = Req(rid, list(input_ids), sampling, return_logprob, generator=gen)
        req.max_total_len = max_total_len
        self.waiting.append(req)
        self.stats["requests"] += 1
        return req

    def _compressed_len(self, prompt_len: int) -> int:
        return 0 if self.shadow_cfg is None else self.shadow_cfg.compressed_len(prompt_len, self.page_size)

    def _check_shadowkv_capacity(self, prompt_len: int) -> None:
        span = self._compressed_len(prompt_len)
        capacity = self.shadow_pool.chunk_capacity * self.shadow_cfg.chunk_size if span else 0
        if span > capacity:
            raise ValueError(f"prompt compresses to {span} tokens but the ShadowKV pools hold "
                             f"{capacity}; raise shadowkv_host_tokens")

    def abort(self, rid: str) -> bool:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                req.finish_reason = {"type": "abort", "message": "aborted"}
                return True
        for req in self.running:
            if req.rid == rid:
                req.finish_reason = {"type": "abort", "message": "aborted"}
                self._release(req)
                self.running.remove(req)
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[ReqUpdate]:
        self._admit()
        updates: list[ReqUpdate] = []
        if not self.running:
            return updates
        items, reqs, budget = [], [], self.args.chunked_prefill_size
        for req in self.running:
            pending = req.pending_tokens()
            if not req.prompt_done:
                if budget <= 0:
                    continue
                pending = pending[:budget]
                budget -= len(pending)
            self._ensure_pages(req, req.num_computed + len(pending))
            if req.shadow is not None and not req.shadow.compressed:
                req.shadow.compress_now = req.num_computed + len(pending) >= len(req.input_ids)
            items.append(StepItem(req.pool_row, pending, req.num_computed, req.shadow))
            reqs.append(req)
        logits = self.runner.forward(items)
        for req in reqs:
            if req.shadow is not None and req.shadow.compress_now:
                self._finish_compression(req)
        sampled_rows = []
        for i, (req, item) in enumerate(zip(reqs, items)):
            req.num_computed += len(item.token_ids)
            if req.prompt_done:
                if len(req.output_ids) == 0 and req.sampling.max_new_tokens == 0:
                    req.finish_reason = {"type": "length", "length": 0}
                else:
                    sampled_rows.append(i)
            self.stats["prefill_tokens" if len(req.output_ids) == 0 else "decode_tokens"] += len(item.token_ids)
        if sampled_rows:
            rows = [self._sampling_row(reqs[i]) for i in sampled_rows]
            tokens, logprobs = sample(logits[sampled_rows], rows)
            for i, token, logprob in zip(sampled_rows, tokens, logprobs):
                req = reqs[i]
                if req.first_token_time is None:
                    req.first_token_time = time.monotonic()
                req.output_ids.append(token)
                req.output_logprobs.append(logprob)
                self._check_finished(req)
                updates.append(ReqUpdate(req, [token], req.finished))
        for req in reqs:
            if req.finished:
                if not any(u.req is req for u in updates):
                    updates.append(ReqUpdate(req, [], True))
                self._release(req)
        self.running = [r for r in self.running if not r.finished]
        return updates

    def _sampling_row(self, req: Req) -> SamplingRow:
        sp = req.sampling
        banned = []
        if len(req.output_ids) < sp.min_new_tokens:
            banned = sorted((set() if sp.ignore_eos else self.eos_ids) | set(sp.stop_token_ids))
        return SamplingRow(sp, req.output_ids, banned, req.generator or self.default_generator)

    def _check_finished(self, req: Req) -> None:
        sp, token = req.sampling, req.output_ids[-1]
        if (token in self.eos_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            req.finish_reason = {"type": "stop", "matched": token}
        elif sp.stop and (matched := self._matched_stop_string(req)) is not None:
            req.finish_reason = {"type": "stop", "matched": matched}
        elif len(req.input_ids) + len(req.output_ids) >= req.max_total_len:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}

    def _matched_stop_string(self, req: Req) -> str | None:
        longest = max(len(s) for s in req.sampling.stop)
        # A stop string spans at most `longest` tokens (each token decodes to >= 1 character).
        tail = self.tokenizer.decode(req.output_ids[-(longest + 1):])
        return next((s for s in req.sampling.stop if s in tail), None)

    # ---- memory -------------------------------------------------------------------------------
    def _pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def _available_pages(self) -> int:
        return self.pool.num_free + self.tree.evictable_pages - self.reserved_pages

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.args.max_running_requests:
            req = self.waiting[0]
            # Leave at least one prompt token to compute: its logits give the first new token.
            match = self.tree.match_prefix(req.input_ids[:len(req.input_ids) - 1])
            self.tree.lock(match.node)
            need = self._pages_for(req.max_total_len) - match.num_pages
            if need > self._available_pages() or self.runner.req_to_token.num_free == 0:
                self.tree.unlock(match.node)
                break  # add_request checked it fits an empty pool: wait for running requests
            if (span := self._compressed_len(len(req.input_ids))) > 0:
                c = self.shadow_cfg.chunk_size
                seg = self.shadow_pool.alloc_segment(0, span, self.shadow_cfg.num_outliers(span // c))
                row = self.runner.decoder.alloc_row() if seg is not None else None
                if row is None:
                    if seg is not None:
                        self.shadow_pool.free_segment(seg)
                    self.tree.unlock(match.node)
                    break  # the compressed pools are full: wait for running requests to finish
                req.shadow = ShadowReqState(seg, row)
            self.waiting.popleft()
            req.pool_row = self.runner.req_to_token.alloc()
            req.last_node = match.node
            req.pages = list(match.pages)
            req.cached_tokens = req.num_computed = match.num_pages * self.page_size
            if match.pages:
                self.runner.req_to_token.write(req.pool_row, 0,
                                               self.pool.slots_of_pages(match.pages, req.num_computed))
            req.reserved_pages = need
            self.reserved_pages += need
            self.stats["cached_tokens"] += req.cached_tokens
            self.running.append(req)

    def _ensure_pages(self, req: Req, num_tokens: int) -> None:
        need = self._pages_for(num_tokens) - len(req.pages)
        if need <= 0:
            return
        if self.pool.num_free < need:
            self.tree.evict(need - self.pool.num_free)
        pages = self.pool.alloc(need)
        if pages is None:  # admission reserved these pages, so this is a bookkeeping bug
            raise PoolExhaustedError(f"pool exhausted while extending request {req.rid}")
        start = len(req.pages) * self.page_size
        self.runner.req_to_token.write(req.pool_row, start, self.pool.slots_of_pages(pages, need * self.page_size))
        req.pages.extend(pages)
        take = min(need, req.reserved_pages)
        req.reserved_pages -= take
        self.reserved_pages -= take

    def _finish_compression(self, req: Req) -> None:
        """The prompt's segment is compressed: give back the dense pages it covered."""
        st = req.shadow
        st.compress_now, st.compressed = False, True
        self.shadow_pool.wait_host_writes()  # the next step's value gathers read them
        own_from = req.cached_tokens // self.page_size  # earlier pages belong to the radix tree
        span_pages = st.segment.num_tokens // self.page_size
        self.pool.free([p for p in req.pages[own_from:span_pages] if p != FREED_PAGE])
        req.pages[own_from:span_pages] = [FREED_PAGE] * max(0, span_pages - own_from)
        self.stats["compressed_requests"] += 1
        self.stats["compressed_tokens"] += st.segment.num_tokens

    def _release(self, req: Req) -> None:
        """Hand the request's computed whole pages to the radix cache and free the rest.

        A compressed request's segment is private to it (for now): it is freed, and so are its
        dense pages, since the radix cache holds only complete dense prefixes.
        """
        if req.shadow is not None:
            self._release_shadow(req)
            if req.shadow.compressed:
                return
        whole = req.num_computed // self.page_size
        tokens = req.all_ids[:whole * self.page_size]
        present = self.tree.insert(tokens, req.pages[:whole])
        matched = req.cached_tokens // self.page_size
        duplicates = req.pages[matched:present]  # cached meanwhile by another request
        self.pool.free(duplicates + req.pages[whole:])
        self.tree.unlock(req.last_node)
        self.runner.req_to_token.free(req.pool_row)
        self.reserved_pages -= req.reserved_pages
        req.reserved_pages = 0
        req.pages = []
        req.pool_row = None

    def _release_shadow(self, req: Req) -> None:
        seg = req.shadow.segment
        if req.shadow.compressed:
            req.shadowkv_info = self._shadow_report(req)
            matched = req.cached_tokens // self.page_size
            self.pool.free([p for p in req.pages[matched:] if p != FREED_PAGE])
            self.tree.unlock(req.last_node)
            self.runner.req_to_token.free(req.pool_row)
            self.reserved_pages -= req.reserved_pages
            req.reserved_pages, req.pages, req.pool_row = 0, [], None
        self.shadow_pool.free_segment(seg)
        self.runner.decoder.free_row(req.shadow.scratch_row)

    def _shadow_report(self, req: Req) -> dict:
        dense_tokens = sum(p != FREED_PAGE for p in req.pages) * self.page_size
        return request_report(self.shadow_pool, self.runner.decoder, req.shadow.segment, req.shadow.scratch_row,
                              dense_tokens, self.pool.bytes_per_token, req.num_computed)

    def shadowkv_stats(self) -> dict | None:
        """Totals over running compressed requests, pool capacity, and the cumulative counters."""
        if self.shadow_pool is None:
            return None
        reports = [self._shadow_report(r) for r in self.running if r.shadow is not None and r.shadow.compressed]
        total = {key: sum(r[key] for r in reports) for key in
                 ("dense_kv_bytes", "gpu_compressed_bytes", "gpu_scratch_bytes", "gpu_total_bytes",
                  "host_bytes", "full_kv_bytes", "chunk_cache_hits", "chunk_cache_lookups")}
        total["gpu_saving_vs_full"] = total["full_kv_bytes"] / total["gpu_total_bytes"] if reports else 0.0
        total["chunk_cache_hit_rate"] = (total["chunk_cache_hits"] / total["chunk_cache_lookups"]
                                         if total["chunk_cache_lookups"] else 0.0)
        return {"config": dataclasses.asdict(self.shadow_cfg), "running_compressed_requests": len(reports),
                "running_total": total, "per_request": {r.rid: rep for r, rep in zip(
                    [r for r in self.running if r.shadow is not None and r.shadow.compressed], reports)},
                "pools": self.shadow_pool.capacity_bytes(),
                "compressed_requests": self.stats["compressed_requests"],
                "compressed_tokens": self.stats["compressed_tokens"]}

    def flush_cache(self) -> bool:
        return self.tree.flush()

    def server_info(self) -> dict:
        runner = self.runner
        return {
            "model_path": runner.loaded.model_path,
            "attention": self.args.attention,
            "attention_backend": runner.backend_name,
            "device": str(runner.device),
            "dtype": str(runner.dtype).removeprefix("torch."),
            "context_length": runner.context_length,
            "memory": self.memory_stats(),
            "shadowkv": self.shadowkv_stats(),
            "stats": dict(self.stats),
            "running_requests": len(self.running),
            "waiting_requests": len(self.waiting),
            "time": time.time(),
        }

    def memory_stats(self) -> dict:
        running_pages = sum(len(r.pages) for r in self.running)
        return {
            "page_size": self.page_size,
            "total_pages": self.pool.capacity,
            "free_pages": self.pool.num_free,
            "tree_pages": self.tree.total_pages,
            "evictable_pages": self.tree.evictable_pages,
            "running_request_pages": running_pages,
            "reserved_pages": self.reserved_pages,
            "kv_bytes_per_token": self.pool.bytes_per_token,
            "radix_nodes": self.tree.num_nodes(),
        }
