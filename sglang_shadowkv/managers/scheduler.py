"""Continuous batching with chunked prefill, and overlap scheduling.

Each step mixes the running requests' decode tokens with prompt chunks (at most
chunked_prefill_size prompt tokens per step) into one forward pass; admission and pages are the
CacheManager's. Pure decode steps replay CUDA graphs on a GPU (ModelRunner).

Overlap: `step()` launches step N (forward and sampling queued on the device, its tokens copied
back asynchronously) and only then processes step N-1's tokens (stop checks, streaming out,
releases), so the CPU work of a step hides behind the GPU work of the next. What makes that
possible: a decode step's input token is the request's last sampled token, read on the device
(ModelRunner.next_input); everything that depends only on what was launched (positions, pages,
prompt completion, ShadowKV's compressed layout) is booked at launch; only what depends on a
token's value waits for it. A request whose output ends on a stop token is thus found one step
late, after one more step that included it was launched; that step's token for it is dropped.
Requests whose next step needs the host to have seen their last token (penalties, a grammar,
logprobs: Req.needs_host_tokens) make the scheduler process the pending step first.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from sglang_shadowkv.constrained import create_grammar_backend
from sglang_shadowkv.constrained.grammar_manager import GrammarManager
from sglang_shadowkv.layers.sampler import SamplingRow, sample
from sglang_shadowkv.mem_cache.memory_plan import documents_that_fit
from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.server_args import ServerArgs

from .cache_manager import CacheManager
from .logprobs import (LogprobOptions, ReqLogprobs, prompt_logit_rows, record_output_logprobs,
                       record_prompt_logprobs)
from .model_runner import ModelRunner, StepItem
from .request import Req

logger = logging.getLogger(__name__)

SHARED_PREFILL_TOKENS = 256  # a shared prefix at least this long (and most of a prompt) is worth waiting for


def shares_prefill(req: Req, prefilling: Req) -> bool:
    """Whether most of req's prompt is what `prefilling` computes now (past its cached prefix),
    and at least SHARED_PREFILL_TOKENS of it: then req waits for that prefill and reuses it."""
    shared = common_prefix_len(req.input_ids, prefilling.input_ids) - prefilling.cached_tokens
    return shared >= SHARED_PREFILL_TOKENS and 2 * shared >= len(req.input_ids) - prefilling.cached_tokens


def common_prefix_len(a: list[int], b: list[int], block: int = 1024) -> int:
    n = min(len(a), len(b))
    pos = 0
    while pos < n and a[pos:pos + block] == b[pos:pos + block]:
        pos += block
    end = min(pos + block, n)
    while pos < end and a[pos] == b[pos]:
        pos += 1
    return min(pos, n)


@dataclass
class ReqUpdate:
    """What one step did for one request: the tokens it produced and, at the end, why it stopped."""
    req: Req
    new_ids: list[int]
    finished: bool


@dataclass
class LaunchedStep:
    """A step queued on the device whose sampled tokens have not been processed yet."""
    sampled: list[Req]  # requests that get a token from this step, in the order of `tokens`
    tokens: torch.Tensor  # [n] on the host, valid once `copied` has completed
    copied: torch.cuda.Event | None  # None on a CPU: the tensors are ready
    prompts_done: list[Req]  # requests with max_new_tokens 0 whose prompt this step completed

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunner | None = None):
        self.args = args
        self.runner = runner or ModelRunner(args)
        self.pool = self.runner.pool
        self.tokenizer = self.runner.tokenizer
        self.page_size = args.page_size
        self.context_length = self.runner.context_length
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.eos_ids = set(self.runner.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.vocab_size = self.runner.config.vocab_size
        self.sampling_device = self.runner.device
        self.default_generator = torch.Generator(device=self.sampling_device).manual_seed(args.random_seed)
        self.stats = {"prefill_tokens": 0, "cached_tokens": 0, "decode_tokens": 0, "decode_steps": 0,
                      "requests": 0}
        self.rejected: list[Req] = []  # dropped at admission; reported by the next step
        self.cache = CacheManager(self.runner, self.page_size, self.stats)
        self.tree, self.shadow = self.cache.tree, self.cache.shadow
        self.overlap = not args.disable_overlap_schedule
        self.pending: LaunchedStep | None = None
        self.grammars = GrammarManager(lambda: create_grammar_backend(
            self.tokenizer, self.vocab_size, sorted(self.eos_ids), args.constrained_json_any_whitespace))
        if self.runner.device.type == "cuda" and not args.skip_server_warmup:
            self.warm_up()

    def warm_up(self) -> None:
        """Run each kind of step once before serving (SGLang's warmup request), so that kernels
        compile (Triton, FlashInfer's JIT) now and not in a user's time to first token. With
        ShadowKV: a document long enough to be compressed, then a question of two 64-query tiles
        over it (the sparse suffix prefill) and its sparse decode. The cache and the counters are
        left as they were."""
        stats = dict(self.stats)
        low = min(1000, self.vocab_size // 4)
        ids = [low + (i * 7919) % (self.vocab_size - 2 * low) for i in range(self.context_length)]
        prompts = [ids[:16]]
        if self.shadow is not None and self.shadow.cfg.min_context + 200 < self.context_length:
            doc = ids[:self.shadow.cfg.min_context + 64]
            prompts = [doc, doc + ids[-100:]]
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            self.add_request(f"warmup-{i}", prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
            while self.has_work:
                self.step()
        self.flush_cache()
        self.stats.clear()
        self.stats.update(stats)
        logger.info("warmup: %d requests in %.1f s", len(prompts), time.perf_counter() - start)

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
        if self.cache.pages_for(max_total_len) > self.pool.capacity:
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
                self.cache.release(req)
                self.running.remove(req)
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.pending or self.grammars.pending)

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[ReqUpdate]:
        """Launch the next step, then process the one before it (see the module docstring)."""
        ready, failed = self.grammars.take_ready(idle=not (self.waiting or self.running or self.pending))
        self.waiting.extend(ready)
        self.rejected.extend(failed)
        self._admit()
        updates = [ReqUpdate(req, [], True) for req in self.rejected]
        self.rejected.clear()
        if self.pending is not None and any(r.needs_host_tokens for r in self.running):
            updates += self._process(self.pending)
            self.pending = None
        items, reqs = self._schedule()
        launched = self._launch(items, reqs) if items else None
        if self.pending is not None:
            updates += self._process(self.pending)
        self.pending = launched
        if launched is not None and not self.overlap:
            updates += self._process(launched)
            self.pending = None
        return updates

    def _admit(self) -> None:
        """Admit waiting requests in order while memory allows. One that shares a long prefix
        with a prompt still being prefilled waits for it (SGLang's in-batch prefix caching): that
        prompt goes to the radix cache when it completes, so a shared document is prefilled (and
        compressed) once however many of its requests arrive together."""
        prefilling = [r for r in self.running if not r.prompt_done]
        deferred = []
        while self.waiting and len(self.running) < self.args.max_running_requests:
            req = self.waiting.popleft()
            if any(shares_prefill(req, other) for other in prefilling):
                deferred.append(req)
                continue
            admitted = self.cache.try_admit(req)
            if not admitted:
                if self.shadow is not None and not self.running and self.pending is None:
                    # nothing running will free the compressed pools: this request can never start
                    req.finish_reason = {"type": "abort", "message": "the ShadowKV pools are full"}
                    self.rejected.append(req)
                    continue
                self.waiting.appendleft(req)
                break  # wait for running requests to finish
            self.running.append(req)
            prefilling.append(req)
        self.waiting.extendleft(reversed(deferred))

    def _schedule(self) -> tuple[list[StepItem], list[Req]]:
        """The next step's work: one decode token per request that may still sample, and prompt
        chunks within the prefill budget."""
        items, reqs, budget = [], [], self.args.chunked_prefill_size
        for req in self.running:
            if req.prompt_done:
                if not req.may_sample or req.finished:
                    continue  # its last token is in flight (or it ended): nothing left to compute
                tokens = []
            else:
                if budget <= 0:
                    continue
                tokens = req.input_ids[req.num_computed:req.num_computed + budget]
                budget -= len(tokens)
            item = StepItem(req.pool_row, tokens, req.num_computed, req.shadow, len(req.input_ids),
                            req.cached_tokens)
            self.cache.ensure_pages(req, item.seq_len)
            if req.shadow is not None and not req.prompt_done:
                completes = item.seq_len >= len(req.input_ids)
                req.shadow.compress_now = completes and req.shadow.segment is not None
            items.append(item)
            reqs.append(req)
        return items, reqs

    def _launch(self, items: list[StepItem], reqs: list[Req]) -> LaunchedStep:
        """Queue the forward pass and the sampling; book what the step does to each request."""
        logit_rows = prompt_logit_rows(reqs, items)  # prompt logprobs need more rows than the last
        logits = self.runner.forward(items, None if logit_rows is None else logit_rows.rows)
        if logit_rows is not None:
            record_prompt_logprobs(reqs, logits, logit_rows)
            logits = logits[logit_rows.last]
        sampled, rows, prompts_done, scored = [], [], [], []
        for i, (req, item) in enumerate(zip(reqs, items)):
            was_prompt = not req.prompt_done
            req.num_computed += item.num_new
            self.stats["decode_tokens" if item.is_decode else "prefill_tokens"] += item.num_new
            if was_prompt and req.prompt_done:
                if req.shadow is not None:
                    self.shadow.on_prompt_done(req)
                self.cache.cache_prompt(req)
                if not req.may_sample:
                    prompts_done.append(req)
                    if req.logprob is not None:  # SGLang scores the next token all the same
                        scored.append(i)
            if req.prompt_done and req.may_sample:
                sampled.append(req)
                rows.append(i)
        self.stats["decode_steps"] += any(it.is_decode for it in items)
        if scored:
            self._record_logprobs([reqs[i] for i in scored], logits[scored])
        if not sampled:
            return LaunchedStep([], torch.zeros(0, dtype=torch.long), None, prompts_done)
        sampled_logits = logits[rows]
        tokens, logprobs = sample(sampled_logits, [self._sampling_row(r) for r in sampled],
                                  self.grammars.vocab_mask(sampled),
                                  with_logprobs=any(r.logprob is not None for r in sampled))
        if logprobs is not None:
            record_output_logprobs(sampled, sampled_logits, tokens.tolist(), logprobs.tolist())
        table_rows = torch.tensor([r.pool_row for r in sampled], device=self.runner.device)
        self.runner.next_input[table_rows] = tokens
        for req in sampled:
            req.num_sampled += 1
        copied = None
        if tokens.is_cuda:  # bring the tokens back without waiting for them here
            tokens = tokens.to("cpu", non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return LaunchedStep(sampled, tokens, copied, prompts_done)

    def _record_logprobs(self, reqs: list[Req], logits: torch.Tensor) -> None:
        """The next token's logprobs of prompt-only requests (max_new_tokens 0), as SGLang reports
        them: of the token the request would have sampled."""
        tokens, logprobs = sample(logits, [self._sampling_row(r) for r in reqs],
                                  self.grammars.vocab_mask(reqs))
        record_output_logprobs(reqs, logits, tokens.tolist(), logprobs.tolist())

    def _process(self, step: LaunchedStep) -> list[ReqUpdate]:
        """The host side of a finished step: append tokens, check stops, release what ended."""
        step.wait()
        updates = []
        for req, token in zip(step.sampled, step.tokens.tolist()):
            if req.finished:
                continue  # it ended (a stop token one step earlier, or an abort): the token is dropped
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            req.output_ids.append(token)
            self.grammars.advance(req, token)
            if not req.finished:
                self._check_finished(req)
            updates.append(ReqUpdate(req, [token], req.finished))
        for req in step.prompts_done:
            if not req.finished:
                req.finish_reason = {"type": "length", "length": 0}
                updates.append(ReqUpdate(req, [], True))
        for update in updates:
            if update.finished:
                self.cache.release(update.req)
        self.running = [r for r in self.running if not r.finished]
        return updates

    def _sampling_row(self, req: Req) -> SamplingRow:
        sp = req.sampling
        banned = []
        if req.num_sampled < sp.min_new_tokens:
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

    # ---- info ---------------------------------------------------------------------------------
    def shadowkv_stats(self) -> dict | None:
        return None if self.shadow is None else self.shadow.server_stats(self.running)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while any request is queued or running, as in
        SGLang (a flush then would only throw away what they are about to reuse). A launched
        step whose requests have all ended holds nothing: it does not count."""
        return not (self.waiting or self.running or self.grammars.pending) and self.tree.flush()

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
            "capacity": self.capacity(),
            "shadowkv": self.shadowkv_stats(),
            "stats": dict(self.stats),
            "steps": {"overlap": self.overlap, "eager_steps": runner.eager_steps,
                      "cuda_graph": None if runner.graphs is None else runner.graphs.stats()},
            "running_requests": len(self.running),
            "waiting_requests": len(self.waiting),
            "time": time.time(),
        }

    def capacity(self) -> dict:
        """How many documents of 16K, 32K and 128K tokens the pools hold at once, dense and (with
        ShadowKV) compressed."""
        store = self.runner.shadow_pool
        compressed = None if store is None else store.chunk_capacity * store.chunk_size
        fit = documents_that_fit(self.pool.capacity * self.page_size, compressed,
                                 None if store is None else store.max_segments)
        return fit if self.runner.memory_plan is None else {**fit, "memory_plan": self.runner.memory_plan}

    def memory_stats(self) -> dict:
        return self.cache.memory_stats(self.running)

    @property
    def reserved_pages(self) -> int:
        return self.cache.reserved_pages
