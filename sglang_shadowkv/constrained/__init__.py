"""Constrained decoding: a grammar-backend interface (base.py), xgrammar behind it, and the
scheduler's grammar manager (compilation off the step, masks before sampling)."""

from .base import GRAMMAR_KINDS, GrammarSpec


def check_grammar(spec: GrammarSpec) -> None:
    """Raise ValueError naming the sampling_params key if the grammar does not parse (no
    tokenizer needed: the HTTP process answers a bad grammar with a 400 before queueing it)."""
    from .xgrammar_backend import XGrammarBackend
    XGrammarBackend.check(spec)


def create_grammar_backend(tokenizer, vocab_size: int, stop_token_ids: list[int], json_any_whitespace: bool):
    from .xgrammar_backend import XGrammarBackend
    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids, json_any_whitespace)


__all__ = ["GRAMMAR_KINDS", "GrammarSpec", "check_grammar", "create_grammar_backend"]
