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
                 return_logprob: bool = False, rid: str | list[str] | None = None):
        """One prompt -> one output dict; a list of prompts -> a list, in order."""
        self._check_open()
        batch_of_ids, single = self._normalize_prompts(prompt, input_ids)
        n = len(batch_of_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        rids = rid if isinstance(rid, list) else [rid] * n
        if len(params) != n or len(rids) != n:
            raise ValueError("sampling_params and rid lists must have one entry per prompt")
        parsed = [SamplingParams.from_dict(p) for p in params]
        with self._lock:
            reqs = []
            try:
                for ids, sp, r in zip(batch_of_ids, parsed, rids):
                    reqs.append(self.scheduler.add_request(
                        r if r is not None else f"engine-{next(self._rids)}", ids, sp, return_logprob))
            except ValueError:
                for req in reqs:
                    self.scheduler.abort(req.rid)
                raise
            self._run_until_finished(reqs)
        outputs = [output_dict(self.tokenizer, r) for r in reqs]
        return outputs[0] if single else outputs

    async def async_generate(self, *args, **kwargs):
        return await asyncio.to_thread(self.generate, *args, **kwargs)

    def _run_until_finished(self, reqs) -> None:
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
