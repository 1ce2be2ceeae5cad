"""The grammar-backend interface of constrained decoding, as SGLang and mini-sglang split it.

A request asks for one grammar (`GrammarSpec`: a regex, a JSON schema or an EBNF grammar). A
backend checks a spec without a tokenizer (so the HTTP process can answer a bad one with a 400),
compiles it against the model's vocabulary (slow enough to run off the scheduler's step, in a
thread), and makes a fresh matcher per request from a compiled grammar (cheap). A matcher tracks
the tokens accepted so far and writes the next allowed tokens into a packed bitmask row; the
sampler masks the logits with it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

# sampling_params keys that hold a grammar; at most one per request
GRAMMAR_KINDS = ("regex", "json_schema", "ebnf")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to; also the compile cache's key."""
    kind: str  # one of GRAMMAR_KINDS
    source: str


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of a bitmask from allocate_bitmask()."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance past `token`; False if the grammar does not allow it (nothing changes then)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar has accepted its end (a stop token after a complete match)."""


class GrammarBackend(ABC):
    @abstractmethod
    def check(self, spec: GrammarSpec) -> None:
        """Raise ValueError naming spec.kind if the grammar does not parse."""

    @abstractmethod
    def compile(self, spec: GrammarSpec) -> object:
        """The compiled grammar (thread-safe, shared by every request with this spec)."""

    @abstractmethod
    def matcher(self, compiled: object) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""

    @abstractmethod
    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        ...

    @abstractmethod
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, row by row, in place."""
