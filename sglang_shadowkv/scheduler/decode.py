"""Decode: the requests whose prompt is done, their next token each step, and the host side of a
finished step (tokens appended, stop conditions, outputs, release)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sglang_shadowkv.constrained.grammar_manager import GrammarManager
from sglang_shadowkv.layers.sampler import SamplingRow
from sglang_shadowkv.model_executor.forward_batch import StepItem

from .cache import CacheManager
from .request import Req


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


class DecodeManager:
    def __init__(self, cache: CacheManager, grammars: GrammarManager, tokenizer, eos_ids: set[int],
                 default_generator: torch.Generator):
        self.cache, self.grammars, self.tokenizer = cache, grammars, tokenizer
        self.eos_ids, self.default_generator = eos_ids, default_generator
        self.running: list[Req] = []  # prompt done, not finished (or finished, not yet processed)

    def schedule(self) -> tuple[list[StepItem], list[Req]]:
        """One decode token per request that may still sample (a request whose last token is in
        flight, or that ended, computes nothing)."""
        items, reqs = [], []
        for req in self.running:
            if not req.may_sample or req.finished:
                continue
            item = StepItem(req.pool_row, [], req.num_computed, req.shadowkv, len(req.input_ids), req.cached_tokens)
            self.cache.prepare(req, item)
            items.append(item)
            reqs.append(req)
        return items, reqs

    def sampling_row(self, req: Req) -> SamplingRow:
        sp = req.sampling
        banned = []
        if req.num_sampled < sp.min_new_tokens:
            banned = sorted((set() if sp.ignore_eos else self.eos_ids) | set(sp.stop_token_ids))
        return SamplingRow(sp, req.output_ids, banned, req.generator or self.default_generator)

    def process(self, step: LaunchedStep) -> list[ReqUpdate]:
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

    def abort(self, rid: str) -> Req | None:
        """End a running request now and release its cache state (None: not running)."""
        for req in self.running:
            if req.rid == rid:
                req.finish_reason = {"type": "abort", "message": "aborted"}
                self.cache.release(req)
                self.running.remove(req)
                return req
        return None

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
