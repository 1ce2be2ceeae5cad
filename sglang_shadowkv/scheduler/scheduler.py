"""The scheduler: a loop over its managers, with continuous batching, chunked prefill and overlap.

Each step takes the requests whose grammar compiled, lets the prefill manager admit waiting ones,
asks the decode manager (one token per running request) and the prefill manager (prompt chunks
within chunked_prefill_size) for the step's work, launches it on the model runner and processes
the previous step's results. The cache manager owns every page, the radix tree and ShadowKV's
compressed tier; pure decode steps replay CUDA graphs on a GPU (model_executor/).

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
import torch

from sglang_shadowkv.constrained import create_grammar_backend
from sglang_shadowkv.constrained.grammar_manager import GrammarManager
from sglang_shadowkv.layers.sampler import sample
from sglang_shadowkv.mem_cache.kv_pool import to_device
from sglang_shadowkv.model_executor.forward_batch import StepItem
from sglang_shadowkv.model_executor.model_runner import ModelRunner, default_chunked_prefill_size
from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.server_args import ServerArgs

from .cache import CacheManager
from .counters import Counters, StepCounters, merged
from .decode import DecodeManager, LaunchedStep, ReqUpdate
from .logprobs import (LogprobOptions, ReqLogprobs, prompt_logit_rows, record_output_logprobs,
                       record_prompt_logprobs)
from .prefill import PrefillManager
from .request import Req, valid_token_ids
from .step_timing import StepTimes, step_detail

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunner | None = None):
        self.args = args
        self.runner = runner or ModelRunner(args)
        self.pool, self.tokenizer = self.runner.pool, self.runner.tokenizer
        self.page_size = args.page_size
        self.context_length = self.runner.context_length
        self.vocab_size = self.runner.config.vocab_size
        self.eos_ids = eos_ids = set(self.runner.config.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.sampling_device = self.runner.device
        self.counters = StepCounters()
        self.cache = CacheManager(self.runner, self.page_size)
        self.grammars = GrammarManager(lambda: create_grammar_backend(
            self.tokenizer, self.vocab_size, sorted(eos_ids), args.constrained_json_any_whitespace))
        self.chunked_prefill_size = args.chunked_prefill_size or default_chunked_prefill_size(self.runner.device)
        self.prefill = PrefillManager(self.cache, self.chunked_prefill_size, args.schedule_policy)
        default_generator = torch.Generator(device=self.sampling_device).manual_seed(args.random_seed)
        self.decode = DecodeManager(self.cache, self.grammars, self.tokenizer, eos_ids, default_generator)
        self.overlap = not args.disable_overlap_schedule
        self.pending: LaunchedStep | None = None
        self.step_times = StepTimes(self.counters, self.runner.device, args.step_log, self.cache.rates)
        self.step_clock, self.device_timer = self.step_times.clock, self.step_times.device_timer
        self.startup_seconds = 0.0  # set by whoever started it, warmup included (managers/ranks.py)

    # ---- submission ---------------------------------------------------------------------------
    def add_request(self, rid: str, input_ids: list[int], sampling: SamplingParams,
                    logprob: LogprobOptions | None = None) -> Req:
        """Validate and queue; raises ValueError naming the problem (nothing is allocated then)."""
        if not input_ids:
            raise ValueError("prompt is empty: give a non-empty text or input_ids")
        if not valid_token_ids(input_ids, self.vocab_size):
            raise ValueError(f"input_ids must be ints in [0, {self.vocab_size})")
        if len(input_ids) >= self.context_length:
            raise ValueError(f"prompt has {len(input_ids)} tokens; the context length is "
                             f"{self.context_length} (prompt plus at least one new token must fit)")
        if any(r.rid == rid for queue in (self.running, self.prefill.waiting, self.grammars.pending) for r in queue):
            raise ValueError(f"rid {rid!r} is already in use")
        if logprob is not None:
            logprob.check(len(input_ids), self.vocab_size)
        max_total_len = min(len(input_ids) + sampling.max_new_tokens, self.context_length)
        self.cache.check_request(len(input_ids), max_total_len)
        gen = None
        if sampling.sampling_seed is not None:
            gen = torch.Generator(device=self.sampling_device).manual_seed(sampling.sampling_seed)
        req = Req(rid, list(input_ids), sampling, generator=gen,
                  logprob=None if logprob is None else ReqLogprobs.for_prompt(logprob, input_ids))
        req.max_total_len = max_total_len
        if not self.grammars.submit(req):  # else it waits there while its grammar compiles
            self.prefill.add(req)
        self.counters.requests += 1
        return req

    def abort(self, rid: str) -> bool:
        if self.grammars.abort(rid) is not None:
            return True
        req = self.prefill.abort(rid)
        if req is not None:
            if req.pool_row is not None:  # admitted: it holds pages and a table row
                self.cache.release(req)
            return True
        return self.decode.abort(rid) is not None

    @property
    def running(self) -> list[Req]:
        """Admitted requests, prefilling or decoding."""
        return self.prefill.prefilling + self.decode.running

    @property
    def has_work(self) -> bool:
        return bool(self.prefill.waiting or self.running or self.pending or self.grammars.pending)

    # ---- one step -----------------------------------------------------------------------------
    def step(self, grammars_ready: list[str] | None = None) -> list[ReqUpdate]:
        """Launch the next step, then process the one before it (see the module docstring).
        grammars_ready: the rids whose grammar joins the queue now (default: those compiled;
        tensor-parallel ranks take rank 0's, managers/rank_mirror.py)."""
        now = time.perf_counter()
        self.step_times.book_last(now)
        if grammars_ready is None:
            grammars_ready = self.grammars_ready()
        ready, failed = self.grammars.take(grammars_ready)
        for req in ready:
            self.prefill.add(req)
        self.prefill.rejected.extend(failed)
        running = self.running
        self.prefill.admit(self.args.max_running_requests - len(running),
                           nothing_in_flight=not running and self.pending is None, running=running)
        self.cache.maintain(self.running, idle=not self.running)
        updates = [ReqUpdate(req, [], True) for req in self.prefill.rejected]
        self.prefill.rejected.clear()
        if self.pending is not None and any(r.needs_host_tokens for r in self.decode.running):
            updates += self.decode.process(self.pending)
            self.pending = None
        decode_items, decode_reqs = self.decode.schedule()
        prefill_items, prefill_reqs = self.prefill.schedule()
        items, reqs = decode_items + prefill_items, decode_reqs + prefill_reqs
        launched = None
        if items:
            queues = (len(self.prefill.waiting), len(self.prefill.prefilling), len(self.decode.running))
            with self.step_times.launch(now, decode_items, prefill_items,
                                        lambda: step_detail(self.cache, prefill_items, decode_items, queues)):
                launched = self._launch(items, reqs)
        if self.pending is not None:
            updates += self.decode.process(self.pending)
        self.pending = launched
        if launched is not None and not self.overlap:
            updates += self.decode.process(launched)
            self.pending = None
        return updates

    def grammars_ready(self) -> list[str]:
        """The rids whose grammar has compiled (failed ones too), waiting a moment when idle."""
        return self.grammars.ready(idle=not (self.prefill.waiting or self.running or self.pending))

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
            if item.is_decode:
                self.counters.decode_tokens += 1
            else:
                self.counters.prefill_tokens += item.num_new
            if was_prompt and req.prompt_done:
                self.cache.prompt_done(req)
                if not req.may_sample:
                    prompts_done.append(req)
                    if req.logprob is not None:  # SGLang scores the next token all the same
                        scored.append(i)
            if req.prompt_done and req.may_sample:
                sampled.append(req)
                rows.append(i)
        self.decode.running += self.prefill.take_done()
        self.counters.decode_steps += any(it.is_decode for it in items)
        if scored:
            self._record_logprobs([reqs[i] for i in scored], logits[scored])
        if not sampled:
            return LaunchedStep([], torch.zeros(0, dtype=torch.long), None, prompts_done)
        # indices go through to_device: a plain host index would wait for the step just queued
        in_order = rows == list(range(len(logits)))
        sampled_logits = logits if in_order else logits[to_device(torch.tensor(rows), logits.device)]
        tokens, logprobs = sample(sampled_logits, [self.decode.sampling_row(r) for r in sampled],
                                  self.grammars.vocab_mask(sampled),
                                  with_logprobs=any(r.logprob is not None for r in sampled))
        tokens = self.runner.tp.broadcast_from_leader(tokens)  # every rank goes on with rank 0's tokens
        if logprobs is not None:
            record_output_logprobs(sampled, sampled_logits, tokens.tolist(), logprobs.tolist())
        table_rows = to_device(torch.tensor([r.pool_row for r in sampled]), self.runner.device)
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
        tokens, logprobs = sample(logits, [self.decode.sampling_row(r) for r in reqs],
                                  self.grammars.vocab_mask(reqs))
        record_output_logprobs(reqs, logits, tokens.tolist(), logprobs.tolist())

    # ---- idle, cache, info --------------------------------------------------------------------
    def run_when_idle(self) -> None:
        """Each time the scheduler goes idle: finish a demotion under way (nothing decodes to be
        slowed), and with --check-integrity check the pool accounting."""
        self.step_times.book_last(time.perf_counter())  # the last step's time ends here, not at the next request
        self.device_timer.collect()
        self.cache.maintain(self.running, idle=True)
        if self.args.check_integrity:
            self.cache.check_integrity(self.running)

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while any request is queued or running, as in
        SGLang (a flush then would only throw away what they are about to reuse). A launched
        step whose requests have all ended holds nothing: it does not count."""
        return not (self.prefill.waiting or self.running or self.grammars.pending) and self.cache.flush()

    @property
    def counter_sets(self) -> list[Counters]:
        """The counters of the scheduler, the cache, its compressed tier and its host tier."""
        tier, host = self.cache.compressed, self.cache.host
        return ([self.counters, self.cache.counters] + ([] if tier is None else [tier.counters])
                + ([] if host is None else [host.counters]))

    @property
    def stats(self) -> dict[str, int]:
        """Every counter, flat (server_info's "stats")."""
        return merged(*self.counter_sets)
