"""SGLang drop-in, through the real clients against one server (embedded model, CPU): frontend
programs with select, regex / JSON-schema gen, fork and run_batch; the openai client with n,
logprobs, echo, batched prompts and response_format; every field of SGLang's request objects
accepted at its default; parallel sampling sharing one prefill."""

import ast
import importlib.util
import json
import pathlib
import re

import httpx
import jsonschema
import pytest
from sglang_shadowkv.testing.live_server import assert_no_pages_held, generate, sse_payloads

from sglang_shadowkv.entrypoints.request_fields import (CHAT_FIELDS, COMPLETION_FIELDS, GENERATE_FIELDS,
                                                        IGNORE, USE, Refused)

AGE = {"type": "object", "required": ["age"], "additionalProperties": False,
       "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 99}}}
SGLANG = pathlib.Path(importlib.util.find_spec("sglang").submodule_search_locations[0])


def stats(url) -> dict:
    return httpx.get(url + "/get_server_info", timeout=30).json()["stats"]


def test_frontend_select_regex_json_fork_and_run_batch(server):
    import sglang as sgl

    @sgl.function
    def survey(s, topic):
        s += f"A short survey about {topic}.\n"
        s += "Q: Do you like it? A: " + sgl.select("like", choices=["yes", "no", "sometimes"]) + "\n"
        branches = s.fork(2)
        for i, branch in enumerate(branches):
            branch += f"Participant {i} phone: " + sgl.gen("phone", regex=r"\d{3}-\d{4}", max_tokens=12)
            branch += "\nRecord: " + sgl.gen("record", json_schema=json.dumps(AGE), max_tokens=48)
        s["records"] = [(b["phone"], b["record"]) for b in branches]

    sgl.set_default_backend(sgl.RuntimeEndpoint(server))
    states = survey.run_batch([{"topic": "rivers"}, {"topic": "tea"}])
    for state in states:
        meta = state.get_meta_info("like")
        scores = meta["normalized_prompt_logprobs"]
        assert state["like"] == ["yes", "no", "sometimes"][scores.index(max(scores))]
        for phone, record in state["records"]:
            assert re.fullmatch(r"\d{3}-\d{4}", phone)
            jsonschema.validate(json.loads(record), AGE)
    # select's prompt logprobs (over a cached prefix, from near its end) equal a full computation
    state = states[0]
    scored = [e[0] for e in state.get_meta_info("like")["input_token_logprobs"][
        ["yes", "no", "sometimes"].index(state["like"])] if e[0] is not None]
    httpx.post(server + "/flush_cache", timeout=30)
    full = generate(server, text="A short survey about rivers.\nQ: Do you like it? A: " + state["like"],
                    sampling_params={"max_new_tokens": 0}, return_logprob=True,
                    logprob_start_len=0)["meta_info"]["input_token_logprobs"]
    assert [e[0] for e in full[-len(scored):]] == pytest.approx(scored, abs=2e-3)


def sglang_fields(path: str, *classes: str) -> dict[str, object]:
    """Fields of SGLang's request classes, read from the installed source (the runtime does not
    import on a CPU machine): name -> default value (a literal, or ... when not one)."""
    tree = ast.parse((SGLANG / path).read_text())
    fields = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and not item.target.id.startswith("_"):
                    fields[item.target.id] = _default(item.value)
    return fields


def _default(value):
    if isinstance(value, ast.Call):  # field(default=...) / Field(default=...)
        value = next((k.value for k in value.keywords if k.arg == "default"), None)
    try:
        return ast.literal_eval(value) if value is not None else ...
    except ValueError:
        return ...


SGLANG_REQUESTS = [
    ("managers/io_struct.py", ("GenerateReqInput",), GENERATE_FIELDS, "/generate",
     {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}),
    ("entrypoints/openai/protocol.py", ("CompletionRequest", "PDRoutingFields"), COMPLETION_FIELDS,
     "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
    ("entrypoints/openai/protocol.py", ("ChatCompletionRequest", "PDRoutingFields"), CHAT_FIELDS,
     "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}),
]


@pytest.mark.parametrize("path, classes, table, route, given", SGLANG_REQUESTS)
def test_every_sglang_field_is_accepted_at_its_default(server, path, classes, table, route, given):
    fields = sglang_fields("srt/" + path, *classes)
    assert len(fields) > 20 and set(fields) <= set(table), sorted(set(fields) - set(table))
    body = {name: value for name, value in fields.items() if value is not ... and value is not None}
    body.update(given)
    resp = httpx.post(server + route, json=body, timeout=120)
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("route, body, field", [
    ("/generate", {"text": "hi", "return_hidden_states": True}, "return_hidden_states"),
    ("/generate", {"text": "hi", "lora_path": "adapter"}, "lora_path"),
    ("/generate", {"text": "hi", "image_data": "cat.png"}, "image_data"),
    ("/generate", {"text": "hi", "sampling_params": {"structural_tag": "{}"}}, "structural_tag"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "(a"}}, "regex"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "continuous_usage_stats"),
])
def test_a_field_asking_for_a_missing_feature_is_a_400_naming_it(server, route, body, field):
    resp = httpx.post(server + route, json=body, timeout=60)
    assert resp.status_code == 400 and field in resp.json()["error"]["message"], resp.text
    assert_no_pages_held(server)


def test_field_tables_classify_every_field():
    for table in (GENERATE_FIELDS, COMPLETION_FIELDS, CHAT_FIELDS):
        for name, policy in table.items():
            assert policy in (USE, IGNORE) or (isinstance(policy, Refused) and policy.reason), name


def test_parallel_sampling_shares_one_prefill(server):
    prompt = "The river town kept its records in a stone archive near the old mill. " * 6
    httpx.post(server + "/flush_cache", timeout=30)
    before = stats(server)
    outs = generate(server, text=prompt, sampling_params={"max_new_tokens": 12, "temperature": 1.0, "n": 4})
    after = stats(server)
    prompt_len = outs[0]["meta_info"]["prompt_tokens"]
    assert len(outs) == 4 and len({o["text"] for o in outs}) > 1
    assert all(o["meta_info"]["cached_tokens"] >= prompt_len - 8 for o in outs)
    # one prefill of the prompt, then each sample only its uncached tail and its own tokens
    assert after["prefill_tokens"] - before["prefill_tokens"] <= prompt_len + 4 * 8
    assert after["requests"] - before["requests"] == 5


def test_openai_completions_n_logprobs_echo_batch(server):
    import openai
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    prompts = ["The capital of France is", "1, 2, 3,"]
    done = client.completions.create(model="default", prompt=prompts, max_tokens=4, n=2, temperature=0,
                                     logprobs=2, echo=True)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    for choice in done.choices:
        prompt = prompts[choice.index // 2]
        assert choice.text.startswith(prompt)
        lp = choice.logprobs
        assert "".join(lp.tokens).startswith(choice.text) and lp.token_logprobs[0] is None
        assert len(lp.top_logprobs) == len(lp.tokens) and lp.top_logprobs[0] is None
        assert lp.text_offset == [len("".join(lp.tokens[:k])) for k in range(len(lp.tokens))]
        for token, value, top in zip(lp.tokens[-4:], lp.token_logprobs[-4:], lp.top_logprobs[-4:]):
            assert max(top.values()) == pytest.approx(value) and top[token] == pytest.approx(value)  # greedy
    assert done.usage.completion_tokens == 16
    ids = client.completions.create(model="m", prompt=[[504, 3575, 282], [504]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2


def test_openai_chat_n_logprobs_response_format_stream_usage(server):
    import openai
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Give a person's age as JSON."}]
    chat = client.chat.completions.create(
        model="default", messages=messages, max_tokens=40, n=2, temperature=0, logprobs=True, top_logprobs=3,
        response_format={"type": "json_schema", "json_schema": {"name": "age", "schema": AGE}})
    assert len(chat.choices) == 2
    for choice in chat.choices:
        jsonschema.validate(json.loads(choice.message.content), AGE)
        content = choice.logprobs.content
        assert "".join(t.token for t in content).startswith(choice.message.content)  # + the end token
        assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    obj = client.chat.completions.create(model="default", messages=messages, max_tokens=48, temperature=0,
                                         response_format={"type": "json_object"})
    text = obj.choices[0].message.content
    assert text.startswith("{") and (obj.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    stream = client.chat.completions.create(model="default", messages=messages, max_tokens=5, n=2,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)]
    assert texts[0] == texts[1] != ""  # greedy: both samples alike


def test_generate_stream_with_logprobs_and_n(server):
    body = {"text": "List three colors:", "stream": True, "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "n": 2, "ignore_eos": True}}
    with httpx.stream("POST", server + "/generate", json=body, timeout=120) as resp:
        events = sse_payloads(list(resp.iter_lines()))
    last = {e["index"]: e for e in events}
    assert set(last) == {0, 1}
    for event in last.values():
        meta = event["meta_info"]
        assert [e[1] for e in meta["output_token_logprobs"]] == event["output_ids"]
        assert "".join(e[2] for e in meta["output_token_logprobs"]) == event["text"]
        assert len(meta["output_top_logprobs"]) == 4
    assert_no_pages_held(server)
