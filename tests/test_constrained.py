"""Constrained decoding with xgrammar on the embedded model (CPU): regex, JSON schema and EBNF
requests batched with unconstrained ones; compilation off the step and cached; bad grammars are
errors naming the key; failures and aborts leak nothing."""

import json
import re
import threading
import time

import jsonschema
import pytest

from conftest import assert_pool_clean
from sglang_shadowkv.sampling_params import SamplingParams

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
EBNF = 'root ::= "The answer is " ("yes" | "no") "."'


def test_grammars_in_a_batch_with_unconstrained_requests(engine):
    free = {"max_new_tokens": 12, "temperature": 0}
    alone = engine.generate("Once upon a time", free)
    outs = engine.generate(
        ["My phone number is", "Describe a person as JSON:", "Is water wet?", "Once upon a time"],
        [{"max_new_tokens": 16, "temperature": 0, "regex": r"\(\d{3}\) \d{3}-\d{4}"},
         {"max_new_tokens": 64, "temperature": 0, "json_schema": json.dumps(PERSON)},
         {"max_new_tokens": 16, "temperature": 0.7, "ebnf": EBNF, "sampling_seed": 3},
         free])
    phone, person, answer, story = outs
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone["text"])
    jsonschema.validate(json.loads(person["text"]), PERSON)
    assert answer["text"] in ("The answer is yes.", "The answer is no.")
    for out in (phone, person, answer):  # each ends when its grammar is complete
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert story["output_ids"] == alone["output_ids"]  # the masks stay in their own rows
    assert_pool_clean(engine)


def test_bad_grammars_name_the_key(engine):
    for params, key in [({"regex": "(unclosed"}, "regex"), ({"json_schema": '{"type": "nope"}'}, "json_schema"),
                        ({"json_schema": "{not json"}, "json_schema"), ({"ebnf": "root ::= missing_rule"}, "ebnf"),
                        ({"regex": "a", "json_schema": "{}"}, "at most one")]:
        with pytest.raises(ValueError, match=key):
            engine.generate("Hi", {"max_new_tokens": 4, **params})
    assert_pool_clean(engine)


def test_compilation_runs_off_the_step_and_is_cached(engine):
    """While a grammar compiles (slowed down here), the scheduler keeps stepping the other
    requests; the request waits outside the queue, then runs; a second request with the same
    grammar does not compile again."""
    sched = engine.scheduler
    backend = sched.grammars.backend
    compile_grammar, release, compiled = backend.compile, threading.Event(), []

    def slow_compile(spec):
        release.wait(30)
        compiled.append(spec)
        return compile_grammar(spec)

    backend.compile = slow_compile
    try:
        regex = {"max_new_tokens": 8, "temperature": 0, "regex": "(red|green|blue)"}
        waiting = sched.add_request("grammar-1", engine.tokenizer.encode("A color:"), SamplingParams.from_dict(regex))
        other = sched.add_request("plain", engine.tokenizer.encode("Count: one, two,"),
                                  SamplingParams(max_new_tokens=6, temperature=0))
        for _ in range(7):  # six tokens; with overlap scheduling the last is seen a step later
            start = time.monotonic()
            sched.step()
            assert time.monotonic() - start < 5  # no step waits for the compilation
        assert other.finished and waiting in sched.grammars.pending and not waiting.output_ids
        release.set()
        while not waiting.finished:
            sched.step()
        again = sched.add_request("grammar-2", engine.tokenizer.encode("Another color:"),
                                  SamplingParams.from_dict(regex))
        assert again.grammar is not None  # the cached grammar: ready at once
        while not again.finished:
            sched.step()
    finally:
        backend.compile = compile_grammar
    assert len(compiled) == 1
    for req in (waiting, again):
        assert engine.tokenizer.decode(req.output_ids, skip_special_tokens=True) in ("red", "green", "blue")
    assert_pool_clean(engine)


def test_failed_compilation_and_abort_leave_nothing_behind(engine):
    sched = engine.scheduler
    backend = sched.grammars.backend
    compile_grammar, hold = backend.compile, threading.Event()

    def failing_compile(spec):
        hold.wait(30)
        raise RuntimeError("out of grammar memory")

    backend.compile = failing_compile
    try:
        hold.set()
        bad = sched.add_request("bad-grammar", engine.tokenizer.encode("Hi"),
                                SamplingParams.from_dict({"max_new_tokens": 4, "regex": "x{2,5}y"}))
        while not bad.finished:
            sched.step()
        assert bad.finish_reason["type"] == "abort" and bad.finish_reason["status_code"] == 400
        assert "regex" in bad.finish_reason["message"]
        hold.clear()  # the next compilation hangs until the request is gone
        pending = sched.add_request("pending", engine.tokenizer.encode("Hi"),
                                    SamplingParams.from_dict({"max_new_tokens": 4, "regex": "z+"}))
        sched.step()
        assert sched.abort("pending") and pending.finish_reason["type"] == "abort"
        assert not sched.has_work
    finally:
        hold.set()
        backend.compile = compile_grammar
    assert_pool_clean(engine)


def test_json_is_compact_by_default(engine):
    """A JSON schema compiles to compact JSON unless any whitespace is asked for: a model that
    loops on whitespace cannot leave its object unclosed at max_tokens."""
    from sglang_shadowkv.constrained import GrammarSpec, create_grammar_backend

    sched = engine.scheduler
    newline = engine.tokenizer.encode("\n")
    assert len(newline) == 1
    spec = GrammarSpec("json_schema", json.dumps(PERSON))
    accepts = {}
    for any_whitespace in (False, True):
        backend = create_grammar_backend(engine.tokenizer, sched.vocab_size, sorted(sched.eos_ids), any_whitespace)
        matcher = backend.matcher(backend.compile(spec))
        assert matcher.accept(engine.tokenizer.encode("{")[0])
        accepts[any_whitespace] = matcher.accept(newline[0])
    assert accepts == {False: False, True: True}
    assert sched.grammars.backend.json_any_whitespace is False
