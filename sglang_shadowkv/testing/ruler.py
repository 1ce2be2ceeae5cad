"""RULER's synthetic tasks (NVIDIA/RULER, scripts/data/synthetic), generated here with no download,
and RULER's scoring; plus a look-alike-facts task of this project's own.

Each task follows RULER's configuration (synthetic.yaml), its prompt templates and answer prefixes
(constants.py) and its string-match-all score: the share of the expected values that appear in the
answer, case-insensitively. What differs, so that nothing is downloaded:
- the `essay` haystack is the standard library's docstrings (testing/corpus.py), not Paul Graham's
  essays, split into sentences by punctuation rather than by nltk;
- words (needle keys, common words) are drawn from the words of those docstrings, not from
  wonderwords' lists; a key is two of them joined by a hyphen, as RULER's adjective-noun pairs;
- the prompt is the model's chat turn (testing/haystack.chat_turn) primed with the answer prefix, as
  RULER's model templates do.
Sizes follow RULER too: the largest haystack whose whole chat prompt plus the task's answer tokens
fits the target length (a binary search over the haystack size).

`lookalike` (not RULER's): a memo of LOOKALIKE_FACTS facts of one template, "The access code for
room <3 digits> is <4 digits>.", in RULER's noise haystack, one asked: every other fact differs
from the right one only in its digits, so its chunks look alike to a chunk selection. As a memo is
asked over and over, LOOKALIKE_FACTS samples in a row share one memo (one hit-path document).
"""

from __future__ import annotations

import functools
import random
import re
import string
import uuid
from dataclasses import dataclass

from sglang_shadowkv.testing.corpus import paragraphs
from sglang_shadowkv.testing.haystack import FILLER, INTRO, chat_turn

NOISE = " ".join(FILLER)  # RULER's noise haystack sentence
DEPTHS = [round(i * 100 / 39) for i in range(40)]  # RULER's needle depths, percent
LOOKALIKE_FACTS = 12

# RULER's constants.py: the task templates ({context} then the question) and answer prefixes
NIAH_TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_v} afterwards.\n{context}\n")
NIAH_QUESTION = "What are all the special magic {type_v} for {query} mentioned in the provided text?"
NIAH_ANSWER = "The special magic {type_v} for {query} mentioned in the provided text are"
VT_TEMPLATE = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
VT_QUESTION = "Question: Find all variables that are assigned the value {query} in the text above."
VT_ANSWER = ("Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\n")
CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
CWE_ANSWER = "Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\n")
FWE_QUESTION = ("Question: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")
FWE_ANSWER = "Answer: According to the coded text above, the three most frequently appeared words are:"
LOOKALIKE_TEMPLATE = "{intro}\n\n{{context}}\n\n".format(intro=INTRO)  # haystack.py's NIAH prompt
LOOKALIKE_FACT = "The access code for room {room} is {code}."
LOOKALIKE_QUESTION = "What is the access code for room {room}?"
LOOKALIKE_ANSWER = "The access code for room {room} is"


@dataclass(frozen=True)
class NiahConfig:
    """One NIAH task of RULER's synthetic.yaml."""
    haystack: str  # noise | essay | needle
    type_k: str  # words | numbers | uuids
    type_v: str
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


NIAH_TASKS = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", num_v=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", num_q=4),
}
# answer tokens per task (RULER's tokens_to_generate; the look-alike answer is one 4-digit code)
ANSWER_TOKENS = {**{name: 128 for name in NIAH_TASKS}, "vt": 30, "cwe": 120, "fwe": 50, "lookalike": 16}
TASKS = tuple(ANSWER_TOKENS)


@dataclass(frozen=True)
class Sample:
    """One prompt of a task: the user turn is `document + question`, the answer primed with
    `answer_prefix`; `outputs` are the values the answer must hold."""
    task: str
    document: str  # what an earlier request caches on the hit path
    question: str
    answer_prefix: str
    outputs: tuple[str, ...]

    def prompt(self, engine) -> list[int]:
        return chat_turn(engine, [{"role": "user", "content": self.document + self.question}], self.answer_prefix)


def string_match_all(prediction: str, outputs: tuple[str, ...]) -> float:
    """RULER's score of one answer: the share of expected values found in it (case-insensitive)."""
    pred = prediction.lower()
    return sum(value.lower() in pred for value in outputs) / len(outputs)


# ---- vocabularies ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def corpus_words() -> tuple[str, ...]:
    """Distinct lowercase words of 4 to 10 letters in the docstring corpus, sorted (RULER: wonderwords)."""
    found = {w for p in paragraphs() for w in re.findall(r"\b[a-z]{4,10}\b", p)}
    return tuple(sorted(found))


@functools.lru_cache(maxsize=1)
def essay_sentences() -> tuple[str, ...]:
    """The docstring corpus as sentences (RULER: Paul Graham's essays through nltk)."""
    return tuple(s for p in paragraphs() for s in re.split(r"(?<=[.!?])\s+", p) if s)


def random_value(kind: str, rng: random.Random) -> str:
    """A needle key or value as RULER draws them: a 7-digit number, a word pair, a uuid4."""
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        return "-".join(rng.sample(corpus_words(), 2))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type must be numbers, words or uuids, got {kind!r}")


def insert_at_depths(sentences: list[str], items: list[str], rng: random.Random) -> list[str]:
    """items inserted in order at distinct depths of RULER's 40-depth grid."""
    cuts = sorted(round(len(sentences) * d / 100) for d in rng.sample(DEPTHS, len(items)))
    out, last = [], 0
    for cut, item in zip(cuts, items):
        out += sentences[last:cut] + [item]
        last = cut
    return out + sentences[last:]


# ---- the tasks: each builds a sample from a haystack size ---------------------------------------
def niah_sample(task: str, size: int, rng: random.Random) -> Sample:
    cfg = NIAH_TASKS[task]
    needle = "One of the special magic {type_v} for {key} is: {value}."
    keys, values, needles = [], [], []
    for _ in range(max(cfg.num_k, cfg.num_q)):
        keys.append(random_value(cfg.type_k, rng))
        values.append([random_value(cfg.type_v, rng) for _ in range(cfg.num_v)])
        needles += [needle.format(type_v=cfg.type_v, key=keys[-1], value=v) for v in values[-1]]
    rng.shuffle(needles)
    if cfg.haystack == "essay":
        context = " ".join(insert_at_depths(list(essay_sentences()[:size]), needles, rng))
    else:
        hay = [NOISE] * size if cfg.haystack == "noise" else [
            needle.format(type_v=cfg.type_v, key=random_value(cfg.type_k, rng), value=random_value(cfg.type_v, rng))
            for _ in range(size)]
        for index, item in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
            hay.insert(index, item)
        context = "\n".join(hay)
    asked = rng.sample(range(len(keys)), cfg.num_q)
    query = ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]] if cfg.num_q > 1 else keys[asked[0]]
    texts = [NIAH_TEMPLATE, NIAH_QUESTION, NIAH_ANSWER]
    type_v = cfg.type_v
    if cfg.num_q * cfg.num_v == 1:  # RULER's singular wording
        texts = [t.replace("Some", "A").replace("are all", "is").replace("are", "is") for t in texts]
        type_v = type_v[:-1]
    document, question, prefix = (t.format(type_v=type_v, query=query, context=context) for t in texts)
    return Sample(task, document, question, prefix, tuple(v for i in asked for v in values[i]))


def vt_chain(rng: random.Random, hops: int = 4) -> tuple[list[str], list[str]]:
    """RULER's variable chain: VAR X0 = <5 digits>, then VAR Xi = VAR Xi-1 (names: 5 capitals)."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        names += [name] if name not in names else []
    lines = [f"VAR {names[0]} = {rng.randint(10000, 99999)}"]
    lines += [f"VAR {names[i + 1]} = VAR {names[i]} " for i in range(hops)]
    return names, lines


def vt_text(size: int, rng: random.Random) -> tuple[str, str, list[str]]:
    """(the context: `size` noise lines with a chain's lines in order among them, the chain's value,
    its variables)."""
    names, lines = vt_chain(rng)
    hay = [NOISE] * size
    for j, pos in enumerate(sorted(rng.sample(range(size), len(lines)))):
        hay.insert(pos + j, lines[j])
    value = lines[0].split("=")[-1].strip()
    context = "\n".join(hay).replace(". \n", ".\n")
    return context, value, names


def vt_sample(task: str, size: int, rng: random.Random) -> Sample:
    """RULER's variable tracking: one chain of 4 hops in noise, after one solved example (its
    one-shot: a chain in 20 noise lines with the answer)."""
    ex_context, ex_value, ex_names = vt_text(20, rng)
    example = (VT_TEMPLATE.format(context=ex_context) + VT_QUESTION.format(query=ex_value) + " "
               + VT_ANSWER.format(num_v=len(ex_names), query=ex_value) + " ".join(ex_names) + "\n")
    context, value, names = vt_text(size, rng)
    return Sample(task, example + VT_TEMPLATE.format(context=context), VT_QUESTION.format(query=value),
                  VT_ANSWER.format(num_v=len(names), query=value), tuple(names))


def cwe_list(num_words: int, common_repeats: int, uncommon_repeats: int, rng: random.Random,
             common: int = 10) -> tuple[str, list[str]]:
    """A numbered shuffled list of num_words distinct words: `common` of them common_repeats times,
    the rest uncommon_repeats times; and the common ones."""
    words = rng.sample(corpus_words(), num_words)
    listed = words[:common] * common_repeats + words[common:] * uncommon_repeats
    rng.shuffle(listed)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), words[:common]


def cwe_sample(task: str, size: int, rng: random.Random, length: int) -> Sample:
    """RULER's common-words extraction, after one solved example: from 4K tokens on, 10 words 30
    times each among `size` - 10 others 3 times each (the example: 40 words, 10 and 3 times);
    shorter, 6 and 1 times (the example: 20 words, 3 and 1 times)."""
    (ex_words, ex_common, ex_other), (common, other) = ((40, 10, 3), (30, 3)) if length >= 4096 else ((20, 3, 1), (6, 1))
    ex_context, ex_answer = cwe_list(ex_words, ex_common, ex_other, rng)
    example = (CWE_TEMPLATE.format(context=ex_context) + CWE_QUESTION + " " + CWE_ANSWER + " "
               + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_answer)) + "\n")
    context, answer = cwe_list(size, common, other, rng)
    return Sample(task, example + CWE_TEMPLATE.format(context=context), CWE_QUESTION, CWE_ANSWER, tuple(answer))


def fwe_sample(task: str, size: int, rng: random.Random, vocab_size: int, alpha: float = 2.0) -> Sample:
    """RULER's frequent-words extraction: `size` coded words (6 random letters) drawn from a
    vocabulary of vocab_size (RULER: the target length / 50) with counts following a zeta law of
    exponent alpha; the most frequent is '...' (noise), the next three are asked."""
    vocab = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."
    zeta = sum(k ** -alpha for k in range(1, 100_000))
    words = [w for k, w in enumerate(ranked, 1) for _ in range(int(size * k ** -alpha / zeta))]
    rng.shuffle(words)
    return Sample(task, FWE_TEMPLATE.format(context=" ".join(words)), FWE_QUESTION, FWE_ANSWER, tuple(ranked[1:4]))


def lookalike_sample(task: str, size: int, rng: random.Random, asked: int) -> Sample:
    """LOOKALIKE_FACTS facts "The access code for room <3 digits> is <4 digits>." at evenly spread
    depths of `size` noise sentences; fact `asked` is the question."""
    rooms = rng.sample(range(100, 1000), LOOKALIKE_FACTS)
    codes = rng.sample(range(1000, 10_000), LOOKALIKE_FACTS)
    hay = [NOISE] * size
    for i in reversed(range(LOOKALIKE_FACTS)):
        hay.insert(round((i + 0.5) / LOOKALIKE_FACTS * size), LOOKALIKE_FACT.format(room=rooms[i], code=codes[i]))
    room = rooms[asked]
    return Sample(task, LOOKALIKE_TEMPLATE.format(context=" ".join(hay)), LOOKALIKE_QUESTION.format(room=room),
                  LOOKALIKE_ANSWER.format(room=room), (str(codes[asked]),))


def build(task: str, size: int, length: int, index: int, seed: int = 0) -> Sample:
    """Sample `index` of a task for a target of `length` tokens with a haystack of `size` units
    (sentences, lines or words), the same for the same arguments."""
    if task == "lookalike":  # LOOKALIKE_FACTS samples in a row share a memo, each asking another fact
        memo, asked = divmod(index, LOOKALIKE_FACTS)
        return lookalike_sample(task, size, random.Random(f"ruler/{seed}/{length}/{task}/{memo}"), asked)
    rng = random.Random(f"ruler/{seed}/{length}/{task}/{index}")
    if task in NIAH_TASKS:
        return niah_sample(task, size, rng)
    if task == "fwe":
        return fwe_sample(task, size, rng, vocab_size=length // 50)
    if task == "cwe":
        return cwe_sample(task, size, rng, length)
    return vt_sample(task, size, rng)


def make_sample(engine, task: str, length: int, index: int, seed: int = 0) -> tuple[Sample, list[int]]:
    """Sample `index` of `task` at `length` tokens and its prompt's token ids: the largest haystack
    whose chat prompt plus the task's answer tokens fits `length` (RULER's binary search; the
    samples of one look-alike memo take its first sample's size, so they share its document)."""
    budget = length - ANSWER_TOKENS[task]
    sizing = index - index % LOOKALIKE_FACTS if task == "lookalike" else index

    def tokens(size: int, at: int) -> tuple[Sample, list[int]]:
        sample = build(task, size, length, at, seed)
        return sample, sample.prompt(engine)

    lo, hi, size = 1, length, 0  # every unit is at least a token
    if task == "cwe":  # ten common words and at least one other, at most every corpus word
        lo, hi = 11, min(hi, len(corpus_words()))
    while lo <= hi:
        mid = (lo + hi) // 2
        if len(tokens(mid, sizing)[1]) <= budget:
            size, lo = mid, mid + 1
        else:
            hi = mid - 1
    sample, ids = tokens(size, index) if size else (None, [])
    if sample is None or len(ids) > budget:
        raise ValueError(f"{task} sample {index} does not fit {length} tokens")
    return sample, ids


__all__ = ["TASKS", "NIAH_TASKS", "ANSWER_TOKENS", "Sample", "string_match_all", "make_sample", "build"]
