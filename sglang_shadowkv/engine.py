"""Offline engine in the style of SGLang's `Engine`: generate() in-process, no server.

    from sglang_shadowkv import Engine
    engine = Engine()                      # embedded SmolLM2-135M-Instruct, dense attention
    out = engine.generate("Hello", {"max_new_tokens": 16, "temperature": 0})
    engine.shutdown()
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import Any

from tqdm import tqdm

from sglang_shadowkv.managers.detokenizer import output_dict
from sglang_shadowkv.managers.io_struct import GenerateReq
from sglang_shadowkv.managers.logprobs import LogprobOptions
from sglang_shadowkv.managers.parallel_sampling import expand_parallel
from sglang_shadowkv.managers.scheduler import Scheduler
from sglang_shadowkv.sampling_params import SamplingParams
from sglang_shadowkv.server_args import ServerArgs


class Engine:
    def __init__(self, model_path: str | None = None, attention: str = "full", **kwargs: Any):
        self.server_args = ServerArgs.from_kwargs(model_path=model_path, attention=attention, **kwargs)
        self.scheduler = Scheduler(self.server_args)
        self.tokenizer = self.scheduler.tokenizer
        self._lock = threading.Lock()
        self._rids = itertools.count()
        self._closed = False

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
        self._check_open()
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
            self._run([GenerateReq(None, ids, SamplingParams(max_new_tokens=0)) for ids in prefixes])
            reqs = self._run(runs)
        outputs = [output_dict(self.tokenizer, r) for r in reqs]
        return outputs[0] if single and len(outputs) == 1 else outputs

    async def async_generate(self, *args, **kwargs):
        return await asyncio.to_thread(self.generate, *args, **kwargs)

    def _run(self, items: list[GenerateReq]) -> list:
        """Queue the requests (none if one is refused) and step until all have finished."""
        reqs = []
        try:
            for item in items:
                rid = item.rid if item.rid is not None else f"engine-{next(self._rids)}"
                reqs.append(self.scheduler.add_request(rid, item.input_ids, item.sampling, item.logprob))
        except ValueError:
            for req in reqs:
                self.scheduler.abort(req.rid)
            raise
        bar = tqdm(total=len(reqs), desc="generate", disable=not self.server_args.show_progress)
        pending = {id(r) for r in reqs}
        while pending:
            for update in self.scheduler.step():
                if update.finished and id(update.req) in pending:
                    pending.discard(id(update.req))
                    bar.update(1)
        while self.scheduler.pending is not None and not self.scheduler.running:
            self.scheduler.step()  # the step launched before the last stop was seen: its tokens are dropped
        bar.close()
        return reqs

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
        with self._lock:
            return self.scheduler.flush_cache()

    def get_server_info(self) -> dict:
        self._check_open()
        return self.scheduler.server_info()

    def shutdown(self) -> None:
        self._closed = True
        self.scheduler = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("engine is shut down")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
