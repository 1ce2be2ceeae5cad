"""Needle-in-a-haystack prompts with no download: repeated filler sentences, needles with random
values, a chat-formatted question and the start of the answer.

Needle forms. `kv` (RULER's): "The special magic number for <word> is: <7 digits>." asked by
its word. `passkey`: "The secret pass key is <5 digits>." Chosen by probing the embedded
SmolLM2-135M-Instruct with full attention over 1K..6K haystacks (2026-11-22): `kv` was retrieved
at 14 of 15 (length, depth) cells, this passkey phrasing at 5 of 6, the classic "The pass key is
<v>. Remember it. <v> is the pass key." at 8 of 15 and with a longer question at 0 of 6 (the model
paraphrases: "a unique identifier ..."). On the full NIAH grid (benchmarks/results/niah.json) full
attention retrieves `kv` at 0.96 and `passkey` at 0.44: the passkey form shows where this small
model itself fails, `kv` is the one it solves. The answer is primed with the needle's own opening
words, so retrieval is a copy rather than a rewording. `code` ("The access code for the <word>
room is <4 digits>.") is the fact of benchmarks/memo_retrieval.py.

Prompt forms of the NIAH grid (FORMS): one `kv` or `passkey` needle, or `multikv`: MULTI_NEEDLES
`kv` needles of different words spread through the haystack, one of them asked (RULER's
multi-key form: the answer must come from the right one of several look-alikes).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again."]
INTRO = "There is important information hidden inside a lot of irrelevant text. Find it and memorize it."
WORDS = ["apple", "river", "window", "falcon", "garden", "silver", "marble", "rocket", "lantern",
         "harbor", "meadow", "copper", "violin", "glacier", "pepper", "canyon", "orchid", "tunnel"]
NEEDLE_FORMS = ("kv", "passkey", "code")
FORMS = ("kv", "passkey", "multikv")
MULTI_NEEDLES = 4


@dataclass(frozen=True)
class Needle:
    form: str
    value: str
    sentence: str  # what is hidden in the haystack
    question: str
    answer_prefix: str  # the start of the assistant's answer

    def found_in(self, text: str) -> bool:
        """Exact retrieval: the needle's value appears in the answer."""
        return self.value in text


def make_needle(form: str, rng: random.Random, word: str | None = None) -> Needle:
    if form == "kv":
        word = word or rng.choice(WORDS)
        value = str(rng.randrange(1_000_000, 10_000_000))
        return Needle(form, value, f"The special magic number for {word} is: {value}.",
                      f"What is the special magic number for {word} mentioned in the provided text?",
                      f"The special magic number for {word} is:")
    if form == "passkey":
        value = str(rng.randrange(10_000, 100_000))
        return Needle(form, value, f"The secret pass key is {value}.", "What is the secret pass key?",
                      "The secret pass key is")
    if form == "code":
        word = word or rng.choice(WORDS)
        value = str(rng.randrange(1000, 10_000))
        return Needle(form, value, f"The access code for the {word} room is {value}.",
                      f"What is the access code for the {word} room?", f"The access code for the {word} room is")
    raise ValueError(f"needle form must be one of {NEEDLE_FORMS}, got {form!r}")


def grid_needles(form: str, depth: float, rng: random.Random) -> tuple[Needle, list[tuple[float, Needle]]]:
    """The asked needle of a NIAH grid cell and every (depth, needle) to hide: for `multikv` the
    asked one at `depth` and MULTI_NEEDLES - 1 others of distinct words evenly spaced after it."""
    if form != "multikv":
        needle = make_needle(form, rng)
        return needle, [(depth, needle)]
    needles = [make_needle("kv", rng, word) for word in rng.sample(WORDS, MULTI_NEEDLES)]
    depths = [(depth + i / MULTI_NEEDLES) % 1.0 for i in range(MULTI_NEEDLES)]
    return needles[0], list(zip(depths, needles))


def haystack(tokenizer, num_tokens: int, needles: list[tuple[float, Needle]]) -> str:
    """About num_tokens tokens of filler with each needle at its depth (0: start, 1: end)."""
    per_sentence = len(tokenizer.encode(" ".join(FILLER), add_special_tokens=False)) / len(FILLER)
    count = max(1, round(num_tokens / per_sentence))
    sentences = [FILLER[i % len(FILLER)] for i in range(count)]
    for depth, needle in sorted(needles, key=lambda pair: -pair[0]):  # deepest first keeps indices
        sentences.insert(round(depth * count), needle.sentence)
    return " ".join(sentences)


def chat_turn(engine, messages: list[dict], answer_prefix: str) -> list[int]:
    """Token ids of a chat ending in the assistant's turn, primed with answer_prefix."""
    text = engine.apply_chat_template(messages) + answer_prefix
    return engine.tokenizer.encode(text, add_special_tokens=False)


def niah_prompt(engine, num_tokens: int, depth: float, needle: Needle,
                hidden: list[tuple[float, Needle]] | None = None) -> list[int]:
    """A haystack holding `hidden` (default: the needle at depth), sized so that the whole chat
    prompt asking for `needle` is about num_tokens tokens."""
    hidden = [(depth, needle)] if hidden is None else hidden
    overhead = len(chat_turn(engine, [{"role": "user", "content": f"{INTRO}\n\n\n\n{needle.question}"}],
                             needle.answer_prefix)) + sum(len(engine.tokenizer.encode(n.sentence)) for _, n in hidden)
    hay = haystack(engine.tokenizer, num_tokens - overhead, hidden)
    content = f"{INTRO}\n\n{hay}\n\n{needle.question}"
    return chat_turn(engine, [{"role": "user", "content": content}], needle.answer_prefix)


__all__ = ["FORMS", "NEEDLE_FORMS", "Needle", "make_needle", "grid_needles", "haystack", "chat_turn", "niah_prompt"]
