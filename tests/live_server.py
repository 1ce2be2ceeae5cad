"""A real `launch_server` on a loopback port, in its own process group, for end-to-end tests.

Its own session makes every process it starts findable (and killable) by group, whatever happens
to the launcher; the log goes to a file, never to a pipe nobody reads (a full pipe would block the
server). Always used as a context manager or stopped with `kill_group` in a finally.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout: float, what: str, period: float = 0.1):
    """Poll condition() until it returns something truthy (returned) or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(period)


def assert_no_pages_held(url: str, timeout: float = 20.0) -> dict:
    """Once the server is idle, every KV page is free or in the radix tree; returns the server info."""
    def idle():
        info = httpx.get(url + "/get_server_info", timeout=30).json()
        mem = info["memory"]
        quiet = info["running_requests"] == 0 and mem["running_request_pages"] == 0 and mem["reserved_pages"] == 0
        return info if quiet else None

    info = wait_until(idle, timeout, "the server going idle with no pages held", period=0.2)
    mem = info["memory"]
    assert mem["free_pages"] + mem["tree_pages"] == mem["total_pages"], mem
    return info


class LiveServer:
    def __init__(self, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang-shadowkv-server-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_shadowkv.launch_server", "--port", str(self.port), *flags],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})

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

    def group(self) -> list[psutil.Process]:
        """The live processes of the server's group (zombies hold nothing and are left out)."""
        alive = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == self.pgid and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        return alive

    def children(self) -> list[psutil.Process]:
        """The launcher's server processes (scheduler first, then detokenizer), not the resource tracker."""
        kids = [p for p in psutil.Process(self.proc.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        return sorted(kids, key=lambda p: p.create_time())

    def kill_group(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        self.log.close()

    def __enter__(self) -> "LiveServer":
        try:
            return self.wait_healthy()
        except BaseException:
            self.kill_group()
            raise

    def __exit__(self, *exc) -> None:
        self.kill_group()
