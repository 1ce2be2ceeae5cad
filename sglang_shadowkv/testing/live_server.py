"""A real `launch_server` on a loopback port, in its own process group, for end-to-end tests and
serving benchmarks.

Its own session makes every process it starts findable (and killable) by group, whatever happens
to the launcher; the log goes to a file, never to a pipe nobody reads (a full pipe would block the
server). Always used as a context manager or stopped with `kill_group` in a finally.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import orjson


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SMALL = ("--max-total-tokens", "16384", "--chunked-prefill-size", "512")  # CPU-sized pools and steps


def wait_until(condition, timeout: float, what: str, period: float = 0.1):
    """Poll condition() until it returns something truthy (returned) or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(period)


def pool_leaks(info: dict) -> dict:
    """What an idle server has not given back, from its /get_server_info answer: KV pages neither
    free nor in the radix tree (nor compressed state's, nor a scratch row's); with ShadowKV,
    segments and host slots (chunk slots: one slot of every compressed pool, host values included)
    neither free nor the tree's, chunk references held outside the tree and scratch rows still
    taken. All zero when nothing leaked."""
    mem = info["memory"]
    leaks = {"pages": mem["total_pages"] - mem["free_pages"] - mem["tree_pages"] - mem.get("compressed_pages", 0)
             - mem.get("scratch_pages", 0),
             "segments": 0, "host_slots": 0, "chunk_refs": 0, "scratch_rows": 0}
    if info.get("shadowkv") is not None:
        held = info["shadowkv"]["holders"]
        leaks.update(segments=held["segments"] - held["free_segments"] - held["tree_segments"] - held["demoting_segments"],
                     host_slots=held["chunk_slots"] - held["free_chunk_slots"] - held["tree_chunk_slots"]
                     - held["demoting_chunk_slots"],
                     chunk_refs=held["chunk_refs"] - held["tree_chunk_refs"],
                     scratch_rows=held["scratch_rows"] - held["free_scratch_rows"])
    return leaks


def wait_idle(url: str, timeout: float = 20.0) -> dict:
    """The server info once no request runs or holds pages (the last ones may still be finishing)."""
    def idle():
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        mem = info["memory"]
        quiet = info["running_requests"] == 0 and mem["running_request_pages"] == 0 and mem["reserved_pages"] == 0
        return info if quiet else None

    return wait_until(idle, timeout, "the server going idle", period=0.2)


def assert_no_pages_held(url: str, timeout: float = 20.0) -> dict:
    """Once the server is idle, every KV page (and ShadowKV segment, host slot and scratch row) is
    free or in the radix tree; returns the server info."""
    info = wait_idle(url, timeout)
    leaks = pool_leaks(info)
    assert not any(leaks.values()), (leaks, info["memory"], (info["shadowkv"] or {}).get("holders"))
    return info


class LiveServer:
    def __init__(self, *flags: str, env: dict[str, str] | None = None):
        """flags: launch_server's; env: extra environment variables of the server processes."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang-shadowkv-server-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_shadowkv.launch_server", "--port", str(self.port), *flags],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})

    @property
    def pgid(self) -> int:
        return self.proc.pid  # a session leader's group id is its pid

    def output(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def wait_healthy(self, timeout: float = 300) -> "LiveServer":
        def up():
            assert self.proc.poll() is None, f"server exited with {self.proc.returncode}:\n{self.output()}"
            return self.healthy()
        wait_until(up, timeout, "the server becoming healthy", period=0.25)
        return self

    def group(self) -> list:
        """The live processes of the server's group (zombies hold nothing and are left out)."""
        import psutil
        alive = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == self.pgid and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        return alive

    def children(self) -> list:
        """The launcher's server processes (scheduler first, then detokenizer), not the resource tracker."""
        import psutil
        kids = [p for p in psutil.Process(self.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        return sorted(kids, key=lambda p: p.create_time())

    def kill_group(self) -> None:
        """Kill the server and its children, and wait until every one has exited: a GPU's memory
        comes back only then, and a server started next would otherwise find it taken."""
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while self.group() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.log.close()

    def __enter__(self) -> "LiveServer":
        try:
            return self.wait_healthy()
        except BaseException:
            self.kill_group()
            raise

    def __exit__(self, *exc) -> None:
        self.kill_group()


@contextlib.contextmanager
def servers(*flag_lists: list[str]):
    """One CPU-sized server per list of extra flags, started together; yields their URLs."""
    live = [LiveServer(*SMALL, *flags) for flags in flag_lists]
    try:
        for server in live:
            server.wait_healthy()
        yield [server.url for server in live]
    finally:
        for server in live:
            server.kill_group()


def generate(url: str, **body) -> dict:
    """POST /generate; the body's JSON answer (a 200 is asserted)."""
    resp = httpx.post(url + "/generate", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def sse_payloads(lines) -> list:
    """The JSON events of a server-sent-event stream that ends with [DONE]."""
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [orjson.loads(e) for e in events[:-1]]
