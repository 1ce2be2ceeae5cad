"""The real server on a loopback port (embedded model, CPU): plain HTTP, the openai client and an
SGLang frontend program, bad input, concurrency and aborts."""

import asyncio

import httpx
import pytest
from sglang_shadowkv.testing.live_server import assert_no_pages_held, generate, sse_payloads

GREEDY = {"max_new_tokens": 8, "temperature": 0}


def test_generate_matches_the_offline_engine(server, engine):
    prompts = ["The capital of France is", "Write a haiku about rivers:"]
    want = [engine.generate(p, GREEDY)["text"] for p in prompts]
    single = generate(server, text=prompts[0], sampling_params=GREEDY)
    assert single["text"] == want[0] and single["meta_info"]["completion_tokens"] == 8
    batch = generate(server, text=prompts, sampling_params=GREEDY)
    assert [o["text"] for o in batch] == want
    ids = engine.tokenizer.encode(prompts[1], add_special_tokens=False)
    assert generate(server, input_ids=ids, sampling_params=GREEDY)["text"] == want[1]


def test_prefix_caching_request_returns_at_once_and_is_reused(server):
    doc = "A long shared document about the river town and its archive. " * 8
    cached = generate(server, text=doc, sampling_params={"max_new_tokens": 0})
    assert cached["text"] == "" and cached["meta_info"]["completion_tokens"] == 0
    again = generate(server, text=doc + "Question: where are the records?", sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] >= cached["meta_info"]["prompt_tokens"] // 8 * 8 - 8 > 0


def test_streaming_is_cumulative_and_ends_like_the_plain_call(server):
    body = {"text": "List three colors:", "sampling_params": GREEDY, "stream": True}
    with httpx.stream("POST", server + "/generate", json=body, timeout=120) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        chunks = sse_payloads(list(resp.iter_lines()))
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert texts[-1] == generate(server, text=body["text"], sampling_params=GREEDY)["text"]


def test_openai_client(server):
    import openai
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert done.choices[0].text == generate(server, text="The capital of France is", sampling_params=GREEDY)["text"]
    assert done.usage.completion_tokens == 8 and done.choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    streamed = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                              stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert chat.choices[0].message.role == "assistant" and text == chat.choices[0].message.content != ""
    any_name = client.completions.create(model="gpt-4", prompt="The capital of France is", max_tokens=8,
                                         temperature=0)  # any model name is served, as SGLang does
    assert any_name.model == "gpt-4" and any_name.choices[0].text == done.choices[0].text


def test_sglang_frontend_program_with_fork(server):
    import sglang as sgl

    @sgl.function
    def two_questions(s, doc):
        s += doc
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" Question {i}: what is kept near the mill? Answer:"
            f += sgl.gen("answer", max_tokens=6, temperature=0)
        s["answers"] = [f["answer"] for f in forks]

    sgl.set_default_backend(sgl.RuntimeEndpoint(server))
    doc = "The river town kept its records in a stone archive near the old mill."
    state = two_questions.run(doc=doc)
    for i, answer in enumerate(state["answers"]):
        prompt = doc + f" Question {i}: what is kept near the mill? Answer:"
        assert answer == generate(server, text=prompt, sampling_params={"max_new_tokens": 6, "temperature": 0})["text"]


@pytest.mark.parametrize("body, field", [
    (b"{not json", "JSON"),
    (b'{"text": 123}', "text"),
    (b'{"text": "hi", "sampling_params": "greedy"}', "sampling_params"),
    (b'{"text": "hi", "sampling_params": {"max_new_tokens": "5"}}', "max_new_tokens"),
    (b'{"text": "hi", "sampling_params": {"max_new_tokens": -1}}', "max_new_tokens"),
    (b'{"text": "hi", "sampling_params": {"temprature": 0}}', "temprature"),
    (b'{"text": ""}', "empty"),
    (b'{"input_ids": [1, 2, 99999999]}', "input_ids"),
    (b'{"input_ids": ' + str([1] * 9000).encode() + b"}", "context length"),
    (b'{"text": "hi", "stream": "yes"}', "stream"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, field):
    resp = httpx.post(server + "/generate", content=body, timeout=60)
    assert resp.status_code == 400 and field in resp.json()["error"]["message"]
    assert httpx.get(server + "/health", timeout=10).status_code == 200


def test_bad_openai_input_is_a_400(server):
    for path, body, field in [
        ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
        ("/v1/chat/completions", {"messages": "hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
    ]:
        resp = httpx.post(server + path, json=body, timeout=60)
        assert resp.status_code == 400 and field in resp.json()["error"]["message"], (path, resp.text)
    assert_no_pages_held(server)


def test_64_concurrent_streams_match_sequential_runs(server):
    prompts = [f"Count from {i} to {i + 5}:" for i in range(16)]
    sequential = {p: generate(server, text=p, sampling_params=GREEDY)["text"] for p in prompts}

    async def stream_one(client, prompt):
        body = {"text": prompt, "sampling_params": GREEDY, "stream": True}
        async with client.stream("POST", server + "/generate", json=body) as resp:
            assert resp.status_code == 200
            return sse_payloads([line async for line in resp.aiter_lines()])[-1]["text"]

    async def all_streams():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(stream_one(client, prompts[i % 16]) for i in range(64)))

    texts = asyncio.run(all_streams())
    assert texts == [sequential[prompts[i % 16]] for i in range(64)]
    assert_no_pages_held(server)


def test_aborts_free_everything(server):
    long_run = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    body = {"text": "Tell me a very long story.", "sampling_params": long_run, "stream": True}
    with httpx.stream("POST", server + "/generate", json=body, timeout=120) as resp:
        lines = resp.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert len(got) >= 2  # mid-stream: now hang up
    assert_no_pages_held(server)

    async def abort_by_rid():
        async with httpx.AsyncClient(timeout=120) as client:
            pending = asyncio.create_task(client.post(server + "/generate", json={
                "text": "Another long story:", "sampling_params": long_run, "rid": "abort-me"}))
            await asyncio.sleep(1.0)
            resp = await client.post(server + "/abort_request", json={"rid": "abort-me"})
            assert resp.status_code == 200
            return (await pending).json()

    out = asyncio.run(abort_by_rid())
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["completion_tokens"] < 400
    assert_no_pages_held(server)
    assert httpx.get(server + "/health_generate", timeout=60).status_code == 200


def test_info_endpoints(server):
    info = httpx.get(server + "/get_model_info", timeout=10).json()
    assert info["model_path"].endswith(".gguf") and info["context_length"] == 8192
    server_info = httpx.get(server + "/get_server_info", timeout=10).json()
    assert server_info["attention"] == "full" and "memory" in server_info and server_info["shadowkv"] is None
    assert httpx.post(server + "/flush_cache", timeout=10).status_code == 200
    assert httpx.get(server + "/get_server_info", timeout=10).json()["memory"]["tree_pages"] == 0
    models = httpx.get(server + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == server_info["served_model_name"]


def test_request_bodies_are_tokenized_off_the_event_loop(tmp_path):
    """Tokenizing a long prompt takes tens of ms: it runs on a parsing thread (the event loop keeps
    streaming other requests), and a ValueError raised there is still the request's 400."""
    import threading

    from starlette.testclient import TestClient

    from sglang_shadowkv.entrypoints.http_server import build_app
    from sglang_shadowkv.managers.tokenizer_manager import ModelInfo, TokenizerManager
    from sglang_shadowkv.server_args import ServerArgs

    threads = []

    class RecordingTokenizer:
        def apply_chat_template(self, messages, tokenize, **kwargs):
            return "".join(m["content"] for m in messages)

        def encode(self, text, add_special_tokens):
            threads.append(threading.current_thread().name)
            return [1] * len(text)

    info = ModelInfo(tokenizer=RecordingTokenizer(), model_path="m", context_length=32, vocab_size=8,
                     max_total_tokens=64)
    tm = TokenizerManager(info, f"ipc://{tmp_path}/scheduler", f"ipc://{tmp_path}/tm")
    try:
        client = TestClient(build_app(tm, ServerArgs()))
        bad_after_tokenizing = [
            ("/generate", {"text": "abc", "stream": "yes"}, "stream"),
            ("/v1/completions", {"model": "m", "prompt": "abc", "logprobs": -1}, "logprobs"),
            ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "abc"}],
                                      "logprobs": "x"}, "logprobs"),
            ("/generate", {"text": 5}, "text"),  # raised on the parsing thread itself
        ]
        for route, body, field in bad_after_tokenizing:
            resp = client.post(route, json=body)
            assert resp.status_code == 400 and field in resp.json()["error"]["message"], (route, resp.text)
        assert threads[0] == threading.current_thread().name  # the manager's own first encode, before any thread
        assert len(threads) == 4 and all(name.startswith("parse") for name in threads[1:])
    finally:
        tm.close()
