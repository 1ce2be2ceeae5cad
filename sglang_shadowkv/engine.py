"""Offline engine in the style of SGLang's `Engine`: generate() in-process, no server.

    from sglang_shadowkv import Engine
    engine = Engine()                      # embedded SmolLM2-135M-Instruct, dense attention
    out = engine.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
    engine.shutdown()                      # or: with Engine() as engine: ...

The model and caches are released by shutdown(), at the end of a `with` block, when the engine is
garbage collected, or at interpreter exit, whichever comes first (a weakref.finalize, so the exit
hook does not keep the engine alive). Any call after that raises EngineShutDown.

With tp_size=N this process is rank 0 of a tensor-parallel group and starts ranks 1..N-1 as
processes that follow it (managers/ranks.py, managers/rank_mirror.py): the same calls, the same answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import logging
import threading
import weakref
from typing import Any

import torch

from tqdm import tqdm

from sglang_shadowkv.managers.rank_mirror import MirroredScheduler
from sglang_shadowkv.managers.ranks import FollowerRanks, start_rank
from sglang_shadowkv.managers.watchdog import StepWatchdog
from sglang_shadowkv.managers.request_output import output_dict
from sglang_shadowkv.managers.io_struct import GenerateReq
from sglang_shadowkv.scheduler.logprobs import LogprobOptions
from sglang_shadowkv.managers.parallel_sampling import expand_parallel
from sglang_shadowkv.scheduler.scheduler import Scheduler
from sglang_shadowkv.scheduler.server_info import server_info
from sglang_shadowkv.diagnostics.selection_probe import shadowkv_report
from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.server_args import ServerArgs

logger = logging.getLogger(__name__)


class EngineShutDown(RuntimeError):
    """The engine was shut down: its model and caches are gone."""


class _Owned:
    """What an engine owns, kept apart from it so that its finalizer can release it without
    referring to (and so keeping alive) the engine itself."""

    def __init__(self, scheduler: Scheduler | MirroredScheduler, followers: FollowerRanks | None):
        self.scheduler: Scheduler | MirroredScheduler | None = scheduler
        self.followers = followers

    def release(self) -> None:
        if self.followers is not None:
            self.scheduler.close()
            self.followers.stop()
        self.scheduler = None
        gc.collect()  # the scheduler and its radix cache refer to each other
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.info("Engine shut down: model and caches released")


class Engine:
    def __init__(self, model_path: str | None = None, attention: str = "full", **kwargs: Any):
        self.server_args = args = ServerArgs.from_kwargs(model_path=model_path, attention=attention, **kwargs)
        if args.tp_size == 1:
            self._owned = _Owned(start_rank(args, 0, ""), None)
        else:
            followers = FollowerRanks(args)
            try:
                scheduler = start_rank(args, 0, followers.init_method)
                followers.wait_ready(args.startup_timeout)
            except BaseException:
                followers.stop()
                raise
            self._owned = _Owned(MirroredScheduler(scheduler, followers.command_paths), followers)
        self._release = weakref.finalize(self, self._owned.release)
        self.tokenizer = self._owned.scheduler.tokenizer
        self._lock = threading.Lock()
        # under tensor parallelism a step waits for every rank: one that never ends stops this
        # process with the stacks in the log, rather than hanging it (managers/watchdog.py)
        self._watchdog = StepWatchdog(args.watchdog_timeout, 0) if args.tp_size > 1 else None
        self._rids = itertools.count()

    @property
    def scheduler(self) -> Scheduler | MirroredScheduler:
        if self._owned.scheduler is None:
            raise EngineShutDown("this Engine is shut down; create a new Engine to generate again")
        followers = self._owned.followers
        if followers is not None and followers.dead():
            rank = followers.dead()[0]
            raise RuntimeError(f"tensor-parallel rank {rank} is gone ({followers.failure(rank)}); "
                               "shut this Engine down and start a new one")
        return self._owned.scheduler

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None,
                 sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 return_logprob: bool = False, rid: str | list[str] | None = None,
                 logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                 token_ids_logprob: list[int] | None = None, return_text_in_logprobs: bool = False):
        """One prompt -> one output dict; a list of prompts -> a list, in order. Sampling n > 1
        gives n outputs per prompt (a list even for one prompt). The logprob arguments are
        SGLang's (meta_info gets input_token_logprobs, output_token_logprobs, ...)."""
        batch_of_ids, single = self._normalize_prompts(prompt, input_ids)
        n = len(batch_of_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        rids = rid if isinstance(rid, list) else [rid] * n
        if len(params) != n or len(rids) != n:
            raise ValueError("sampling_params and rid lists must have one entry per prompt")
        logprob = LogprobOptions.from_fields(logprob_start_len, top_logprobs_num, token_ids_logprob,
                                             return_text_in_logprobs) if return_logprob else None
        prefixes, runs = expand_parallel([GenerateReq(r, ids, SamplingParams.from_dict(p), logprob)
                                          for ids, p, r in zip(batch_of_ids, params, rids)])
        with self._lock:
            scheduler = self.scheduler
            for run in runs:
                run.sampling.check_token_ids(scheduler.vocab_size)
            self._run(scheduler, [GenerateReq(None, ids, SamplingParams(max_new_tokens=0)) for ids in prefixes])
            reqs = self._run(scheduler, runs)
        outputs = [output_dict(self.tokenizer, r) for r in reqs]
        return outputs[0] if single and len(outputs) == 1 else outputs

    async def async_generate(self, *args, **kwargs):
        return await asyncio.to_thread(self.generate, *args, **kwargs)

    def _run(self, scheduler: Scheduler, items: list[GenerateReq]) -> list:
        """Queue the requests (none if one is refused) and step until all have finished."""
        reqs = []
        try:
            for item in items:
                rid = item.rid if item.rid is not None else f"engine-{next(self._rids)}"
                reqs.append(scheduler.add_request(rid, item.input_ids, item.sampling, item.logprob))
        except ValueError:
            for req in reqs:
                scheduler.abort(req.rid)
            raise
        bar = tqdm(total=len(reqs), desc="generate", disable=not self.server_args.show_progress)
        pending = {id(r) for r in reqs}
        while pending:
            with self._watch("step"):
                updates = scheduler.step()
            for update in updates:
                if update.finished and id(update.req) in pending:
                    pending.discard(id(update.req))
                    bar.update(1)
        with self._watch("the last step"):
            while scheduler.pending is not None and not scheduler.running:
                scheduler.step()  # the step launched before the last stop was seen: its tokens are dropped
        if not scheduler.has_work:
            with self._watch("run_when_idle"):
                scheduler.run_when_idle()
        bar.close()
        return reqs

    def _watch(self, what: str):
        """Under tensor parallelism, a call that waits in a collective is watched (a step, the
        idle-time work, the server info): one that never ends stops the process with every
        thread's stack in the log."""
        return self._watchdog.watch(what) if self._watchdog is not None else contextlib.nullcontext()

    def _normalize_prompts(self, prompt, input_ids) -> tuple[list[list[int]], bool]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) or input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            texts = [prompt] if single else prompt
            if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
                raise ValueError("prompt must be a string or a list of strings")
            if any(t == "" for t in texts):
                raise ValueError("prompt is empty: give a non-empty text")
            return [self.tokenizer.encode(t, add_special_tokens=False) for t in texts], single
        if not isinstance(input_ids, list) or not input_ids:
            raise ValueError("input_ids must be a non-empty list of token ids (or of such lists)")
        single = not isinstance(input_ids[0], list)
        return ([input_ids] if single else input_ids), single

    # ---- chat, cache, info --------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def flush_cache(self) -> bool:
        with self._lock, self._watch("flush_cache"):
            return self.scheduler.flush_cache()

    def get_server_info(self) -> dict:
        scheduler = self.scheduler
        with self._watch("server_info"):
            return scheduler.server_info() if isinstance(scheduler, MirroredScheduler) else server_info(scheduler)

    def shadowkv_report(self, prompt: str | None = None, input_ids: list[int] | None = None,
                        settings: list[dict] | None = None, num_queries: int = 16) -> list[dict]:
        """How ShadowKV would attend over one long prompt, layer by layer, against exact attention
        on the side: the ranks chosen, per scoring rule the recall of attention mass and the chunks
        chosen, the output error of the low-rank keys alone and of the whole approximation, and
        the GPU saving (managers/shadowkv_probe.py). Works on any engine (also attention="full").
        settings: one report per entry, each a dict of ShadowKVConfig fields changed from this
        engine's (default: one report at this engine's); the prompt is prefilled once for all.
        `shadowkv.selection_report.format_report(report["summary"])` prints one as a table."""
        if self.server_args.tp_size > 1:
            raise ValueError("shadowkv_report runs on one rank: start the Engine with tp_size=1")
        batch, single = self._normalize_prompts(prompt, input_ids)
        if not single:
            raise ValueError("shadowkv_report takes one prompt (a string or one list of token ids)")
        ids = batch[0]
        with self._lock:
            runner = self.scheduler.runner
            configs = [dataclasses.replace(self.server_args.shadowkv, **fields).resolve_storage(runner.device.type == "cuda")
                       for fields in settings or [{}]]
            self.scheduler.cache.make_room(-(-len(ids) // runner.pool.page_size))  # cached prefixes make room
            return shadowkv_report(runner, ids, configs, num_queries)

    def shutdown(self) -> None:
        """Release the model and caches now (a generate() running in another thread finishes first)."""
        with self._lock:
            self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
