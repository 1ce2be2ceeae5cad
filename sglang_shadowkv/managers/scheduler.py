"""Continuous batching with chunked prefill over a paged pool and a radix prefix cache.

Each step mixes the running requests' decode tokens with prompt chunks (at most
chunked_prefill_size prompt tokens per step) into one forward pass. A request is admitted only
when the pool, counting what the radix cache could evict, can hold its prompt plus its full
max_new_tokens: once running it never waits for memory and is never preempted. A finished or
aborted request leaves its whole pages in the radix cache for later requests to reuse.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass

import torch

from sglang_shadowkv.constrained import create_grammar_backend
from sglang_shadowkv.constrained.grammar_manager import GrammarManager
from sglang_shadowkv.layers.sampler import SamplingRow, sample
from sglang_shadowkv.mem_cache.kv_pool import PoolExhaustedError
from sglang_shadowkv.mem_cache.radix_cache import RadixCache
from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.server_args import ServerArgs

from .logprobs import (LogprobOptions, ReqLogprobs, prefix_match_limit, prompt_logit_rows,
                       record_output_logprobs, record_prompt_logprobs)
from .model_runner import ModelRunner, StepItem
from .request import Req
from .shadowkv_manager import ShadowKVManager

logger = logging.getLogger(__name__)


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
        self.tree = RadixCache(self.page_size, self._release_entries)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reserved_pages = 0
        self.eos_ids = set(self.runner.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.vocab_size = self.runner.config.vocab_size
        self.sampling_device = self.runner.device
        self.default_generator = torch.Generator(device=self.sampling_device).manual_seed(args.random_seed)
        self.stats = {"prefill_tokens": 0, "cached_tokens": 0, "decode_tokens": 0, "requests": 0}
        self.rejected: list[Req] = []  # dropped at admission; reported by the next step
        self.shadow = (ShadowKVManager(self.runner, self.tree, self.page_size, self.stats)
                       if self.runner.shadow_cfg is not None else None)
        self.grammars = GrammarManager(lambda: create_grammar_backend(
            self.tokenizer, self.vocab_size, sorted(self.eos_ids)))

    def _release_entries(self, entries: list) -> None:
        if self.shadow is not None:
            self.shadow.release_entries(entries)
        else:
            self.pool.free(entries)

    # ---- submission ---------------------------------------------------------------------------
    def add_request(self, rid: str, input_ids: list[int], sampling: SamplingParams,
                    logprob: LogprobOptions | None = None) -> Req:
        """Validate and queue; raises ValueError naming the problem (nothing is allocated then)."""
        if not input_ids:
            raise ValueError("prompt is empty: give a non-empty text or input_ids")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
               for t in input_ids):
            raise ValueError(f"input_ids must be ints in [0, {self.vocab_size})")
        if len(input_ids) >= self.context_length:
            raise ValueError(f"prompt has {len(input_ids)} tokens; the context length is "
                             f"{self.context_length} (prompt plus at least one new token must fit)")
        if any(r.rid == rid for queue in (self.running, self.waiting, self.grammars.pending) for r in queue):
            raise ValueError(f"rid {rid!r} is already in use")
        if logprob is not None:
            logprob.check(len(input_ids), self.vocab_size)
        max_total_len = min(len(input_ids) + sampling.max_new_tokens, self.context_length)
        if self._pages_for(max_total_len) > self.pool.capacity:
            raise ValueError(
                f"prompt plus max_new_tokens needs {max_total_len} KV tokens but the pool holds "
                f"{self.pool.capacity * self.page_size}; lower max_new_tokens or raise max_total_tokens")
        if self.shadow is not None:
            self.shadow.check_capacity(len(input_ids))
        gen = None
        if sampling.sampling_seed is not None:
            gen = torch.Generator(device=self.sampling_device).manual_seed(sampling.sampling_seed)
        req = Req(rid, list(input_ids), sampling, generator=gen,
                  logprob=None if logprob is None else ReqLogprobs.for_prompt(logprob, input_ids))
        req.max_total_len = max_total_len
        if not self.grammars.submit(req):  # else it waits there while its grammar compiles
            self.waiting.append(req)
        self.stats["requests"] += 1
        return req

    def abort(self, rid: str) -> bool:
        if self.grammars.abort(rid) is not None:
            return True
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
        return bool(self.waiting or self.running or self.grammars.pending)

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[ReqUpdate]:
        ready, failed = self.grammars.take_ready(idle=not (self.waiting or self.running))
        self.waiting.extend(ready)
        self.rejected.extend(failed)
        self._admit()
        updates = [ReqUpdate(req, [], True) for req in self.rejected]
        self.rejected.clear()
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
            if req.shadow is not None and not req.prompt_done:
                completes = req.num_computed + len(pending) >= len(req.input_ids)
                req.shadow.compress_now = completes and req.shadow.segment is not None
            items.append(StepItem(req.pool_row, pending, req.num_computed, req.shadow,
                                  len(req.input_ids), req.cached_tokens))
            reqs.append(req)
        prompt_was_done = [req.prompt_done for req in reqs]
        logit_rows = prompt_logit_rows(reqs, items)  # prompt logprobs need more rows than the last
        logits = self.runner.forward(items, None if logit_rows is None else logit_rows.rows)
        if logit_rows is not None:
            record_prompt_logprobs(reqs, logits, logit_rows)
            logits = logits[logit_rows.last]
        sampled_rows = []
        for i, (req, item) in enumerate(zip(reqs, items)):
            req.num_computed += len(item.token_ids)
            if req.shadow is not None and req.prompt_done and not prompt_was_done[i]:
                self.shadow.on_prompt_done(req)
            if req.prompt_done:
                if len(req.output_ids) == 0 and req.sampling.max_new_tokens == 0:
                    req.finish_reason = {"type": "length", "length": 0}
                if not req.finished or req.logprob is not None:  # SGLang scores the next token
                    sampled_rows.append(i)
            self.stats["prefill_tokens" if len(req.output_ids) == 0 else "decode_tokens"] += len(item.token_ids)
        if sampled_rows:
            rows = [self._sampling_row(reqs[i]) for i in sampled_rows]
            sampled, sampled_logits = [reqs[i] for i in sampled_rows], logits[sampled_rows]
            tokens, logprobs = sample(sampled_logits, rows, self.grammars.vocab_mask(sampled))
            record_output_logprobs(sampled, sampled_logits, tokens, logprobs)
            for req, token in zip(sampled, tokens):
                if req.finished:  # a prompt-only request: it reported the next token's logprob
                    continue
                if req.first_token_time is None:
                    req.first_token_time = time.monotonic()
                req.output_ids.append(token)
                self.grammars.advance(req, token)
                if not req.finished:
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
            match = self.tree.match_prefix(req.input_ids[:prefix_match_limit(req)])
            self.tree.lock(match.node)
            # matched compressed chunks need dense pages while the prompt is prefilled
            need = self._pages_for(req.max_total_len) - sum(isinstance(e, int) for e in match.pages)
            if need > self._available_pages() or self.runner.req_to_token.num_free == 0:
                self.tree.unlock(match.node)
                break  # add_request checked it fits an empty pool: wait for running requests
            if self.shadow is not None:
                req.shadow = self.shadow.plan(req, match.pages)
                if req.shadow is False:
                    req.shadow = None
                    self.tree.unlock(match.node)
                    if not self.running:  # nothing will free the compressed pools
                        self.waiting.popleft()
                        req.finish_reason = {"type": "abort", "message": "the ShadowKV pools are full"}
                        self.rejected.append(req)
                        continue
                    break  # the compressed pools are full: wait for running requests to finish
            self.waiting.popleft()
            req.pool_row = self.runner.req_to_token.alloc()
            req.last_node = match.node
            req.pages = list(match.pages)
            req.num_borrowed = match.num_pages
            req.cached_tokens = req.num_computed = match.num_pages * self.page_size
            if req.pages:  # compressed entries get their (temporary) pages in restore_matched
                dense = [e if isinstance(e, int) else 0 for e in req.pages]
                self.runner.req_to_token.write(req.pool_row, 0, self.pool.slots_of_pages(dense, req.num_computed))
            req.reserved_pages = need
            self.reserved_pages += need
            if req.shadow is not None:
                self.shadow.restore_matched(req)
                req.reserved_pages -= len(req.temp_pages)
                self.reserved_pages -= len(req.temp_pages)
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

    def _release(self, req: Req) -> None:
        """Hand the request's computed whole pages (dense or compressed) to the radix cache and
        release the rest."""
        if req.shadow is not None:
            self.shadow.before_release(req)
        whole = req.num_computed // self.page_size
        tokens = req.all_ids[:whole * self.page_size]
        present = self.tree.insert(tokens, req.pages[:whole])
        duplicates = req.pages[req.num_borrowed:present]  # cached meanwhile by another request
        self._release_entries(duplicates + req.pages[whole:])
        self.tree.unlock(req.last_node)
        self.runner.req_to_token.free(req.pool_row)
        self.reserved_pages -= req.reserved_pages
        req.reserved_pages = 0
        req.pages = []
        req.pool_row = None

    def shadowkv_stats(self) -> dict | None:
        return None if self.shadow is None else self.shadow.server_stats(self.running)

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
        running_pages = sum(sum(isinstance(e, int) for e in r.pages[r.num_borrowed:]) + len(r.temp_pages)
                            for r in self.running)
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
