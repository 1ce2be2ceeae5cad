"""Real servers for the end-to-end tests: launch on free loopback ports, wait until healthy, stop."""

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx
import orjson

SMALL = ["--max-total-tokens", "16384", "--chunked-prefill-size", "512"]  # CPU-sized pools and steps


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not become healthy in {timeout_s} s"
        time.sleep(1)


@contextlib.contextmanager
def servers(*flag_lists: list[str]):
    """One sglang-shadowkv server per list of extra flags, started together; yields their URLs."""
    procs, urls = [], []
    try:
        for flags in flag_lists:
            port = free_port()
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "sglang_shadowkv.launch_server", "--port", str(port), *SMALL, *flags],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs, urls):
            wait_healthy(proc, url)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)


def generate(url, **body):
    """POST /generate; the body's JSON answer (a 200 is asserted)."""
    resp = httpx.post(url + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def assert_no_pages_held(url, timeout=20.0):
    """Wait until the server runs nothing, then check every page is free or in the radix cache."""
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        mem = info["memory"]
        if info["running_requests"] == 0 and mem["running_request_pages"] == 0 and mem["reserved_pages"] == 0:
            assert mem["free_pages"] + mem["tree_pages"] == mem["total_pages"]
            return
        assert time.monotonic() < deadline, info
        time.sleep(0.2)


def sse_payloads(lines) -> list:
    """The JSON events of a server-sent-event stream that ends with [DONE]."""
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [orjson.loads(e) for e in events[:-1]]
