"""Two ShadowKV servers behind the real sglang-router (cache_aware): the three generation routes
answer through it, and requests sharing a long document land on the worker that compressed it.
Then the README's frontend program runs, exactly as written, against a worker."""

import json
import pathlib
import re
import subprocess
import sys
import time

import httpx
import pytest
from sglang_shadowkv.testing.live_server import free_port, generate, servers

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "frontend_shared_document.py"
# eager: the document is compressed at its first prefill, so routing is checked on compressed state
SHADOWKV = ["--attention", "shadowkv", "--shadowkv-min-context", "512", "--shadowkv-compress-policy", "eager"]
GREEDY = {"max_new_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def cluster():
    """(router URL, worker URLs)."""
    with servers(SHADOWKV, SHADOWKV) as workers:
        port = free_port()
        router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers,
             "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-port", str(free_port()), "--log-level", "warn"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for_workers(router, url, len(workers))
            yield url, workers
        finally:
            router.terminate()
            router.wait(timeout=30)


def wait_for_workers(router: subprocess.Popen, url: str, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert router.poll() is None, router.stdout.read()
        try:
            resp = httpx.get(url + "/workers", timeout=2)
            if resp.status_code == 200 and len(resp.json().get("workers", [])) == count:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the router did not register the workers"
        time.sleep(0.5)


def stats(url: str) -> dict:
    info = httpx.get(url + "/get_server_info", timeout=30).json()
    return {**info["stats"], **{k: info["shadowkv"][k] for k in ("compressions", "compressed_prefix_hits")}}


def test_the_three_routes_answer_through_the_router(cluster):
    router, workers = cluster
    prompt = "The capital of France is"
    direct = generate(workers[0], text=prompt, sampling_params=GREEDY)["text"]
    assert generate(router, text=prompt, sampling_params=GREEDY)["text"] == direct
    done = httpx.post(router + "/v1/completions", timeout=120,
                      json={"model": "default", "prompt": prompt, "max_tokens": 3, "temperature": 0})
    assert done.status_code == 200 and done.json()["choices"][0]["text"] == direct
    chat = httpx.post(router + "/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 3,
        "temperature": 0, "logprobs": True})
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"][0]
    assert choice["message"]["content"] and len(choice["logprobs"]["content"]) == 3


def test_requests_sharing_a_document_land_on_the_worker_that_holds_it(cluster):
    router, workers = cluster
    sys.path.insert(0, str(EXAMPLE.parent))
    from frontend_shared_document import town_archive

    document = town_archive()  # ~800 tokens: compressed (min context 512)
    before = [stats(w) for w in workers]
    for question in ("When was the mill built?", "Who kept the bridge?", "When was the school built?"):
        out = generate(router, text=document + f"Question: {question}\nAnswer:", sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] > 700
    delta = [{k: after[k] - b[k] for k in after} for b, after in zip(before, (stats(w) for w in workers))]
    holder, other = sorted(delta, key=lambda d: -d["requests"])
    assert holder["requests"] == 3 and other["requests"] == 0
    assert holder["compressions"] == 1 and holder["compressed_prefix_hits"] == 2
    assert other["compressions"] == 0 and holder["cached_tokens"] > 1400


def test_the_readme_frontend_program_runs_as_written(cluster):
    _, workers = cluster
    worker = workers[1]
    httpx.post(worker + "/flush_cache", timeout=30)
    before = stats(worker)
    run = subprocess.run([sys.executable, str(EXAMPLE), "--url", worker], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for answer in report["answers"]:
        assert answer["found"] in ("yes", "no") and re.fullmatch(r"1[0-9]{3}", answer["year"])
    after = stats(worker)
    branches = len(report["answers"])
    assert after["compressions"] - before["compressions"] == 1  # the document, once
    # every request of every branch (select's prefix and choices, the regex gen) reused it
    assert after["compressed_prefix_hits"] - before["compressed_prefix_hits"] == 4 * branches
