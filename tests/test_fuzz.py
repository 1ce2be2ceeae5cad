"""Generated request bodies against every route of a live server: wrong types, huge numbers, NaN,
deep nesting, odd unicode, very long strings, random token ids and unknown fields, built around
each route's real fields so that they reach the checks behind the JSON parser.

What must hold: never a 5xx, never a message that says "internal error" (a field error names the
field), never an answer slower than a bound; afterwards the server is healthy, gives the same
greedy text as before, and every KV page is free or in the radix tree. The server's context is 64
tokens, so even a huge max_new_tokens that is accepted finishes in a second or two; examples are
derandomized so that CI runs the same ones every time.
"""

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang_shadowkv.testing.live_server import assert_no_pages_held

from sglang_shadowkv.entrypoints.request_fields import (CHAT_FIELDS, COMPLETION_FIELDS, GENERATE_FIELDS,
                                                        OPENAI_SAMPLING)
from sglang_shadowkv.sampling_params import UNSUPPORTED_KEYS, SamplingParams

ANSWER_BOUND_S = 30.0
GREEDY = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
GET_ROUTES = ["/health", "/health_generate", "/get_model_info", "/get_server_info", "/server_info",
              "/v1/models", "/metrics", "/flush_cache"]

huge_numbers = st.sampled_from([2**31, 2**63 - 1, 2**64 - 1, 2**64, 10**30, -2**63, 1e308, -1e308, 5e-324])
numbers = st.one_of(st.integers(-3, 8), st.floats(-3, 3), huge_numbers,
                    st.floats(allow_nan=True, allow_infinity=True))  # NaN/inf: not JSON, a 400 for the body
odd_text = st.one_of(st.text(max_size=40),
                     st.text(st.characters(codec="utf-8"), max_size=20),
                     st.sampled_from(["", " ", "\x00", "\ud800", "\ufffd" * 5, "<|im_end|>", "<|endoftext|>",
                                      "\u202e" + "x" * 3, "🙂" * 10]))
long_text = st.builds(lambda piece, n: piece * n, st.text(min_size=1, max_size=4), st.integers(100, 100_000))
scalars = st.one_of(st.none(), st.booleans(), numbers, odd_text)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10)
token_ids = st.one_of(st.integers(0, 49151), st.integers(-5, 10**6), huge_numbers, scalars)
id_lists = st.one_of(st.lists(token_ids, max_size=12), st.lists(st.lists(token_ids, max_size=6), max_size=3),
                     st.integers(1, 5000).map(lambda n: [7] * n))
anything = st.one_of(scalars, json_values, long_text, id_lists)
BROKEN = {"logit_bias": st.dictionaries(st.one_of(st.integers(-5, 10**6).map(str), odd_text), numbers, max_size=3),
          "stop": st.one_of(odd_text, st.lists(odd_text, max_size=3)), "stop_token_ids": id_lists,
          "input_ids": id_lists, "text": st.one_of(odd_text, long_text, st.lists(odd_text, max_size=4)),
          "prompt": st.one_of(odd_text, long_text, id_lists)}

UNKNOWN_FIELD = "(an unknown field)"

# ---- valid requests ------------------------------------------------------------------------------
short_text = st.one_of(st.sampled_from(["The capital of France is", "Count: 1, 2,", "Hi"]),
                       st.text(st.characters(codec="utf-8"), min_size=1, max_size=30))
valid_ids = st.lists(st.integers(0, 49151), min_size=1, max_size=20)
VALID_SAMPLING = {
    "max_new_tokens": st.integers(0, 6), "min_new_tokens": st.integers(0, 3), "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1), "top_k": st.sampled_from([-1, 1, 5, 50]), "min_p": st.floats(0, 1),
    "frequency_penalty": st.floats(-2, 2), "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "stop": st.lists(st.text(min_size=1, max_size=5), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3), "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(), "spaces_between_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(), "sampling_seed": st.integers(0, 2**64 - 1),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3)}
OPENAI_NAMES = {native: openai for openai, native in OPENAI_SAMPLING.items() if native in VALID_SAMPLING}
valid_sampling = st.fixed_dictionaries({"max_new_tokens": VALID_SAMPLING["max_new_tokens"]},
                                       optional={k: v for k, v in VALID_SAMPLING.items() if k != "max_new_tokens"})
valid_openai = st.fixed_dictionaries({"max_tokens": VALID_SAMPLING["max_new_tokens"]}, optional={
    "stream": st.booleans(), **{OPENAI_NAMES[k]: v for k, v in VALID_SAMPLING.items() if k in OPENAI_NAMES and k != "max_new_tokens"}})
valid_generate = st.builds(lambda prompt, sp, extra: {**prompt, "sampling_params": sp, **extra},
                           st.one_of(st.fixed_dictionaries({"text": short_text}),
                                     st.fixed_dictionaries({"input_ids": valid_ids})),
                           valid_sampling, st.fixed_dictionaries({}, optional={
                               "stream": st.booleans(), "return_logprob": st.booleans(),
                               "rid": st.uuids().map(str)}))
valid_completion = st.builds(lambda body, prompt: {**body, "prompt": prompt}, valid_openai,
                             st.one_of(short_text, valid_ids))
valid_chat = st.builds(lambda body, text: {**body, "messages": [{"role": "user", "content": text}]},
                       valid_openai, short_text)


def broken(valid: st.SearchStrategy[dict], fields) -> st.SearchStrategy[dict]:
    """A valid body with up to two of `fields` (a.b: field b of object a, a.0.b: of its first
    item) set to something else, or given an unknown field: so that most requests get past the
    checks that others fail."""
    @st.composite
    def build(draw):
        body = draw(valid)
        paths = draw(st.lists(st.sampled_from([UNKNOWN_FIELD, *sorted(fields)]), max_size=2, unique=True))
        for path in sorted(paths, key=lambda p: -p.count(".")):  # nested first: a parent may be replaced
            if path == UNKNOWN_FIELD:
                body[draw(st.text(min_size=1, max_size=12))] = draw(json_values)
                continue
            *parents, key = path.split(".")
            target = body
            for parent in parents:  # a number indexes a list
                target = target[int(parent)] if parent.isdigit() else target.setdefault(parent, {})
            target[key] = draw(st.one_of(BROKEN.get(key, numbers), anything))
        return body
    return build()


sampling_paths = {f"sampling_params.{name}" for name in SamplingParams.__dataclass_fields__} | {
    f"sampling_params.{name}" for name in UNSUPPORTED_KEYS}
bodies = st.one_of(
    st.tuples(st.just("/generate"), broken(valid_generate, set(GENERATE_FIELDS) | sampling_paths)),
    st.tuples(st.just("/v1/completions"), broken(valid_completion, set(COMPLETION_FIELDS))),
    st.tuples(st.just("/v1/chat/completions"),
              broken(valid_chat, set(CHAT_FIELDS) | {"messages.0.role", "messages.0.content"})),
    st.tuples(st.just("/abort_request"), broken(st.fixed_dictionaries({"rid": st.text(max_size=8)}), {"rid"})),
    st.tuples(st.just("/flush_cache"), json_values),
)
raw_bodies = st.one_of(st.binary(max_size=64), st.integers(1, 3000).map(lambda d: b"[" * d + b"]" * d),
                       st.integers(1, 3000).map(lambda d: b'{"text": ' + b"[" * d + b"]" * d + b"}"))


def check_answer(resp: httpx.Response, what) -> None:
    assert resp.status_code < 500, (what, resp.status_code, resp.text[:500])
    if resp.status_code >= 400 and resp.headers.get("content-type", "").startswith("application/json"):
        message = resp.json()["error"]["message"]
        assert "internal error" not in message, (what, message)


def send(client: httpx.Client, route: str, content: bytes) -> None:
    with client.stream("POST", route, content=content, headers={"content-type": "application/json"}) as resp:
        resp.read()  # a stream is read to its end: an error mid-stream would break it
    check_answer(resp, (route, content[:300]))


def test_fuzzed_requests_never_fail_the_server(small_server):
    url = small_server.url
    before = httpx.post(url + "/generate", json=GREEDY, timeout=60).json()["text"]
    limits = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

    with httpx.Client(base_url=url, timeout=ANSWER_BOUND_S) as client:
        @limits
        @given(st.one_of(bodies.map(lambda rb: (rb[0], json.dumps(rb[1]).encode())),
                         st.tuples(st.sampled_from(["/generate", "/v1/completions", "/v1/chat/completions"]),
                                   raw_bodies)))
        def posts(route_and_content):
            send(client, *route_and_content)

        @settings(limits, max_examples=30)
        @given(st.sampled_from(GET_ROUTES), st.dictionaries(st.text(max_size=8), st.text(max_size=30), max_size=3))
        def gets(route, params):
            check_answer(client.get(route, params=params), (route, params))

        posts()
        gets()

    assert small_server.healthy()
    assert httpx.post(url + "/generate", json=GREEDY, timeout=60).json()["text"] == before
    assert_no_pages_held(url)
