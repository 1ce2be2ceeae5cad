"""The grammar backend on xgrammar (SGLang's default): regex, JSON schema and EBNF, on CPU or GPU.

xgrammar compiles a grammar against the tokenizer's vocabulary once (a per-token mask cache) and
then answers each step's allowed-token bitmask in microseconds; the bitmask is applied to the
logits on whatever device they are on.
"""

from __future__ import annotations

import torch
import xgrammar as xgr

from .base import GrammarBackend, GrammarMatcher, GrammarSpec


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher):
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self._matcher.accept_token(token)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()


class XGrammarBackend(GrammarBackend):
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], json_any_whitespace: bool):
        """vocab_size: the model's (logits width), which may exceed the tokenizer's.
        json_any_whitespace False: JSON schemas compile to compact JSON (small models otherwise
        fill their max_tokens with whitespace and leave the object unclosed)."""
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.json_any_whitespace = json_any_whitespace

    @staticmethod
    def check(spec: GrammarSpec) -> None:
        parse = {"regex": xgr.Grammar.from_regex, "json_schema": xgr.Grammar.from_json_schema,
                 "ebnf": xgr.Grammar.from_ebnf}[spec.kind]
        try:
            parse(spec.source)
        except (RuntimeError, ValueError) as err:  # xgrammar's parse errors, JSON errors
            raise ValueError(f"sampling_params.{spec.kind} is not a valid {spec.kind}: "
                             f"{_last_line(err)}") from None

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        if spec.kind == "regex":
            return self.compiler.compile_regex(spec.source)
        if spec.kind == "json_schema":
            return self.compiler.compile_json_schema(spec.source, any_whitespace=self.json_any_whitespace)
        return self.compiler.compile_grammar(spec.source)

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=self.vocab_size)


def _last_line(err: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location: keep the reason."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
