"""Stopping the server and the Engine: signals, a killed launcher, a dead or crashing scheduler,
and the Engine's release of its model (context manager, garbage collection, interpreter exit).

Servers run the tiny random model (a second to load), all started at once by one fixture; each
test stops its own the way it is about."""

import gc
import os
import pickle
import signal
import subprocess
import sys
import threading
import weakref

import httpx
import orjson
import pytest
import zmq
from sglang_shadowkv.testing.live_server import LiveServer, wait_until

from sglang_shadowkv.engine import Engine, EngineShutDown
from sglang_shadowkv.entrypoints.launcher import EXIT_PROCESS_DIED, EXIT_STOPPED, Stop, _Uvicorn
from sglang_shadowkv.managers.io_struct import ControlReq

LONG_RUN = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}  # a minute or more on a CPU


@pytest.fixture(scope="module")
def fleet(tiny_model_path):
    servers = [LiveServer("--model-path", tiny_model_path, "--max-total-tokens", "16384") for _ in range(5)]
    try:
        for server in servers:
            server.wait_healthy()
        yield servers
    finally:
        for server in servers:
            server.kill_group()


def running_requests(server: LiveServer) -> int:
    return httpx.get(server.url + "/get_server_info", timeout=10).json()["running_requests"]


def post_in_background(server: LiveServer, body: dict) -> dict:
    """POST /generate from a thread; the returned dict gets the response (or the error) when it ends."""
    result: dict = {}

    def run():
        try:
            result["response"] = httpx.post(server.url + "/generate", json=body, timeout=30)
        except httpx.HTTPError as err:
            result["error"] = err

    result["thread"] = threading.Thread(target=run, daemon=True)
    result["thread"].start()
    return result


def assert_ended_by(request: dict, reason: str) -> None:
    """A request the server could not finish got a clean answer naming why: a 503 if it had no
    output yet, else its partial result finished as "abort"."""
    request["thread"].join(timeout=10)
    resp = request["response"]
    if resp.status_code == 503:
        assert reason in resp.json()["error"]["message"]
        return
    finish = resp.json()["meta_info"]["finish_reason"]
    assert resp.status_code == 200 and finish["type"] == "abort" and reason in finish["message"], resp.text


def assert_group_gone(server: LiveServer) -> None:
    wait_until(lambda: not server.group(), 10, "every process of the server's group exiting")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda sig: sig.name)
def test_stop_signal_ends_in_flight_requests_and_every_process(fleet, sig):
    server = fleet.pop()
    plain = post_in_background(server, {"text": "t9 t8 t7", "sampling_params": LONG_RUN})
    body = {"text": "t5 t6 t7", "sampling_params": LONG_RUN, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=30) as resp:
        events = (line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: "))
        next(events)
        wait_until(lambda: running_requests(server) == 2, 10, "both requests running")
        os.kill(server.proc.pid, sig)
        rest = list(events)  # the stream must end, not hang (30 s read timeout)
    assert rest[-1] == "[DONE]"
    reason = f"the server is shutting down (stopped by {sig.name})"
    assert orjson.loads(rest[-2])["meta_info"]["finish_reason"] == {"type": "abort", "message": reason}
    assert_ended_by(plain, reason)
    assert server.proc.wait(timeout=10) == EXIT_STOPPED
    assert_group_gone(server)
    assert f"stopped by {sig.name}; all server processes stopped" in server.output()


def test_one_sigint_stops_gracefully_and_a_second_one_forces_the_exit():
    """uvicorn reads a SIGINT that finds its should_exit already set as a second Ctrl-C and exits
    at once, cutting open streams: the server's stop (which sets should_exit too) must come after
    uvicorn's own handling. Set first, on a loaded machine a SIGINT cut the stream of
    test_stop_signal_ends_in_flight_requests_and_every_process before its abort and [DONE]."""
    import uvicorn

    stop = Stop()
    server = _Uvicorn(uvicorn.Config(app=None), stop)
    stop.server = server
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and not server.force_exit and stop.reason == "stopped by SIGINT"
    server.handle_exit(signal.SIGINT, None)
    assert server.force_exit


def test_sigkill_of_the_launcher_takes_its_children_down(fleet):
    server = fleet.pop()
    assert len(server.children()) == 2
    os.kill(server.proc.pid, signal.SIGKILL)
    assert_group_gone(server)


def test_a_killed_scheduler_takes_the_server_down_naming_the_cause(fleet):
    server = fleet.pop()
    waiting = post_in_background(server, {"text": "t5 t6", "sampling_params": LONG_RUN})
    wait_until(lambda: running_requests(server) == 1, 10, "the request running")
    server.children()[0].kill()  # as the kernel's out-of-memory killer would
    wait_until(lambda: not server.healthy(), 10, "/health failing")
    assert server.proc.wait(timeout=10) == EXIT_PROCESS_DIED
    assert "the scheduler process was killed by SIGKILL" in server.output()
    assert_ended_by(waiting, "the scheduler process was killed by SIGKILL")
    assert_group_gone(server)


def test_a_crash_in_the_scheduler_loop_takes_the_server_down_naming_the_error(fleet):
    server = fleet.pop()
    scheduler = server.children()[0]
    path = next(c.laddr for c in scheduler.net_connections("unix") if c.laddr.endswith("/scheduler"))
    with zmq.Context() as ctx, ctx.socket(zmq.PUSH) as push:
        push.setsockopt(zmq.LINGER, 0)
        push.connect("ipc://" + path)
        push.send(pickle.dumps(ControlReq(0, "no-such-call")))  # a KeyError outside the step handler
        assert server.proc.wait(timeout=10) == EXIT_PROCESS_DIED
    assert "the scheduler process exited with code 1: KeyError: 'no-such-call'" in server.output()
    assert_group_gone(server)


# ---- Engine -------------------------------------------------------------------------------------
def small_engine(path: str) -> Engine:
    return Engine(model_path=path, max_total_tokens=2048)


def test_engine_as_a_context_manager_releases_the_model(tiny_model_path):
    with small_engine(tiny_model_path) as engine:
        runner = weakref.ref(engine.scheduler.runner)
        assert engine.generate("t5 t6", {"max_new_tokens": 4})["meta_info"]["completion_tokens"] == 4
    gc.collect()
    assert runner() is None
    for call in (lambda: engine.generate("t5"), engine.get_server_info, engine.flush_cache):
        with pytest.raises(EngineShutDown, match="shut down"):
            call()
    engine.shutdown()  # again: nothing to do


def test_engine_is_released_when_garbage_collected(tiny_model_path):
    engine = small_engine(tiny_model_path)
    runner = weakref.ref(engine.scheduler.runner)
    del engine
    gc.collect()
    assert runner() is None


def test_engine_shuts_down_at_interpreter_exit(tiny_model_path):
    script = ("import logging, sys; logging.basicConfig(level=logging.INFO, stream=sys.stdout)\n"
              "from sglang_shadowkv import Engine\n"
              f"engine = Engine(model_path={tiny_model_path!r}, max_total_tokens=2048)\n"
              "print('generated', engine.generate('t5', {'max_new_tokens': 2})['meta_info']['completion_tokens'])\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "generated 2" in lines and "Engine shut down: model and caches released" in lines[-1]


def _die_by_sigkill(writer) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_child_killed_while_starting_is_named_with_its_signal():
    """A scheduler the out-of-memory killer takes while it loads (e.g. an 8B model on a small
    machine) closes its status pipe unreported: the launch fails naming the signal, not EOFError."""
    import multiprocessing as mp

    from sglang_shadowkv.entrypoints.launcher import LaunchError, Stop, _wait_ready

    ctx = mp.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_die_by_sigkill, args=(writer,), name="sglang-shadowkv-scheduler")
    child.start()
    writer.close()
    child.join(timeout=30)
    with pytest.raises(LaunchError, match="scheduler process was killed by SIGKILL.*out-of-memory"):
        _wait_ready(reader, child, 30, Stop())
