"""Long chat prompts that more than one benchmark asks the same questions of, so their results stay
comparable: a chat over stdlib prose (fidelity, selection sweep) and the memo of look-alike facts
(memo retrieval, suffix fidelity, selection sweep, hit fidelity), and the multi-turn NIAH chats
(multi-turn NIAH, hit fidelity)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from sglang_shadowkv.testing.corpus import document
from sglang_shadowkv.testing.haystack import INTRO, WORDS, Needle, chat_turn, haystack, make_needle

if TYPE_CHECKING:
    from sglang_shadowkv import Engine

QUESTION = "\n\nIn two sentences, what is the text above about?"


def chat_prompt(engine: Engine, tokens: int, seed: int) -> list[int]:
    """A chat asking what about `tokens` tokens of stdlib documentation (seeded) are about."""
    doc = engine.tokenizer.decode(document(engine.tokenizer, tokens, seed))
    text = engine.apply_chat_template([{"role": "user", "content": doc + QUESTION}])
    return engine.tokenizer.encode(text, add_special_tokens=False)


def memo_prompts(engine: Engine, memo_tokens: int, facts: int, seed: int) -> tuple[list[list[int]], list[Needle]]:
    """One prompt per fact: the same memo of about memo_tokens tokens, then that fact's question."""
    rng = random.Random(f"memo/{seed}")
    needles = [make_needle("code", rng, word) for word in rng.sample(WORDS, facts)]
    memo = haystack(engine.tokenizer, memo_tokens, [((i + 0.5) / facts, n) for i, n in enumerate(needles)])
    return [chat_turn(engine, [{"role": "user", "content": f"{INTRO}\n\n{memo}\n\n{n.question}"}], n.answer_prefix)
            for n in needles], needles


def make_chat(tokenizer, doc_tokens: int, turns: int, seed: int) -> dict:
    """Needles at evenly spaced depths, asked in a random order (turn 1 is not always the shallowest)."""
    rng = random.Random(f"multi-turn/{seed}")
    needles = [make_needle("kv", rng, word) for word in rng.sample(WORDS, turns)]
    depths = [(i + 0.5) / turns for i in range(turns)]
    order = list(range(turns))
    rng.shuffle(order)
    return {"seed": seed, "doc": haystack(tokenizer, doc_tokens, list(zip(depths, needles))),
            "asked": [(depths[i], needles[i]) for i in order]}


__all__ = ["QUESTION", "chat_prompt", "make_chat", "memo_prompts"]
