"""Sampling parameters with SGLang's names and defaults, checked once at submission.

Every error names the offending key, so the HTTP layer can turn it into a 400 as it is.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from sglang_shadowkv.constrained import GRAMMAR_KINDS, GrammarSpec, check_grammar

# Keys of SGLang's SamplingParams this engine does not implement: the values that mean "unset"
# (SGLang's frontend sends [] and ""), which pass, and why any other value is refused.
UNSUPPORTED_KEYS = {
    "structural_tag": ((None, ""), "tool-call structural tags are not supported (use json_schema, "
                                   "regex or ebnf)"),
    "stop_regex": ((None, [], ""), "stop_regex is not supported (use stop strings, or a regex grammar)"),
    "beam_width": ((None, 1), "beam search is not supported"),
    "watermark": ((None,), "watermarking is not supported"),
}
SAMPLING_EPS = 1e-6  # SGLang's: a lower temperature is greedy (dividing by it overflows the logits)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range; a larger bias overflows float32 logits into NaN probabilities
MIN_REPETITION_PENALTY = 1e-3  # dividing logits by a near-zero penalty makes them infinite


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    stream_interval: int | None = None
    sampling_seed: int | None = None
    logit_bias: dict[int, float] | None = None  # token id (an int, or its decimal string) -> bias
    custom_params: dict[str, Any] | None = None
    # constrained decoding (constrained/): at most one of these
    regex: str | None = None
    json_schema: str | None = None  # a JSON schema, as a JSON string
    ebnf: str | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def grammar(self) -> GrammarSpec | None:
        kind = next((k for k in GRAMMAR_KINDS if getattr(self, k) is not None), None)
        return None if kind is None else GrammarSpec(kind, getattr(self, kind))

    @property
    def has_penalties(self) -> bool:
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @classmethod
    def from_dict(cls, params: dict[str, Any] | None) -> "SamplingParams":
        if params is None:
            return cls()
        if not isinstance(params, dict):
            raise ValueError(f"sampling_params must be a dict, got {type(params).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {}
        for key, value in params.items():
            if key in UNSUPPORTED_KEYS:
                unset, reason = UNSUPPORTED_KEYS[key]
                if value not in unset:
                    raise ValueError(f"sampling_params.{key}: {reason}")
                continue
            if key not in known:
                raise ValueError(f"unknown sampling_params key {key!r}; known: {sorted(known)}")
            if value is not None:
                values[key] = value
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        if isinstance(values.get("stop_token_ids"), int):
            values["stop_token_ids"] = [values["stop_token_ids"]]
        if isinstance(values.get("json_schema"), dict):  # a schema object rather than its text
            values["json_schema"] = json.dumps(values["json_schema"])
        for key in GRAMMAR_KINDS:  # SGLang's frontend sends "" for an unset regex
            if values.get(key) == "":
                del values[key]
        sp = cls(**values)
        sp.validate()
        return sp

    def validate(self) -> None:
        _check_int(self, "max_new_tokens", 0)
        _check_int(self, "min_new_tokens", 0)
        _check_int(self, "top_k", -1)
        _check_int(self, "n", 1)
        if self.top_k == 0:
            raise ValueError("sampling_params.top_k must be -1 (no limit) or at least 1, got 0")
        _check_float(self, "temperature", 0.0, None)
        if self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        _check_float(self, "top_p", 0.0, 1.0, open_low=True)
        _check_float(self, "min_p", 0.0, 1.0)
        _check_float(self, "frequency_penalty", -2.0, 2.0)
        _check_float(self, "presence_penalty", -2.0, 2.0)
        _check_float(self, "repetition_penalty", MIN_REPETITION_PENALTY, None)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError("sampling_params.stop must be a non-empty string or a list of them")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError("sampling_params.stop_token_ids must be a list of non-negative ints")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sampling_params.{name} must be a boolean")
        if self.sampling_seed is not None:
            _check_int(self, "sampling_seed", 0)
            if self.sampling_seed >= 2**64:
                raise ValueError(f"sampling_params.sampling_seed must be < 2**64, got {self.sampling_seed}")
        if self.logit_bias is not None:
            self.logit_bias = _checked_logit_bias(self.logit_bias)
        self._validate_grammar()

    def _validate_grammar(self) -> None:
        given = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of sampling_params.{', '.join(GRAMMAR_KINDS)}; got {given}")
        for key in given:
            if not isinstance(getattr(self, key), str):
                raise ValueError(f"sampling_params.{key} must be a string")
        if given:
            check_grammar(self.grammar)

    def check_token_ids(self, vocab_size: int) -> None:
        """Token ids in the parameters exist in the model's vocabulary (known only to the server)."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"sampling_params.{name} has token id {bad[0]} outside the vocabulary "
                                 f"[0, {vocab_size})")


def _checked_logit_bias(bias) -> dict[int, float]:
    """{token id: bias} with int keys; JSON object keys are strings, so "42" means token 42."""
    if not isinstance(bias, dict):
        raise ValueError(f"sampling_params.logit_bias must be an object of token id -> bias, got "
                         f"{type(bias).__name__}")
    checked = {}
    for key, value in bias.items():
        if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            token = key
        elif isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18:
            token = int(key)
        else:
            raise ValueError(f"sampling_params.logit_bias key {key!r} is not a token id (a non-negative "
                             "integer or its decimal string)")
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or abs(value) > MAX_LOGIT_BIAS):
            raise ValueError(f"sampling_params.logit_bias[{key!r}] must be a number in "
                             f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r}")
        checked[token] = float(value)
    return checked


def _check_int(sp: SamplingParams, name: str, low: int) -> None:
    value = getattr(sp, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sampling_params.{name} must be an integer, got {value!r}")
    if value < low:
        raise ValueError(f"sampling_params.{name} must be >= {low}, got {value}")


def _check_float(sp: SamplingParams, name: str, low: float, high: float | None,
                 open_low: bool = False) -> None:
    value = getattr(sp, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"sampling_params.{name} must be a number, got {value!r}")
    too_low = value <= low if open_low else value < low
    if too_low or (high is not None and value > high) or not math.isfinite(value):
        bound = f"({low}, {high}]" if open_low else f"[{low}, {high if high is not None else 'inf'}]"
        raise ValueError(f"sampling_params.{name} must be in {bound}, got {value}")
    setattr(sp, name, float(value))
