"""Tensor parallelism on a CPU: the ranks are processes joined by gloo, each holding its share of
a tiny random Llama (4 heads, 2 KV heads, float32), as they would be GPUs joined by NCCL."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from sglang_shadowkv.testing.live_server import SMALL, LiveServer, assert_no_pages_held, wait_until
from tiny_model import SHADOWKV

GREEDY = {"max_new_tokens": 10, "temperature": 0}
SAMPLED = {"max_new_tokens": 10, "temperature": 0.8, "top_p": 0.9, "sampling_seed": 7}
MODES = {"full": {}, "shadowkv": SHADOWKV}


def _document_and_questions() -> tuple[list[int], list[list[int]]]:
    doc = [(7 * i) % 500 + 2 for i in range(700)]
    return doc, [[(11 * i + j) % 500 + 2 for i in range(20)] for j in range(3)]


def _run(path: str, tp_size: int, flags: dict) -> tuple[list, dict]:
    """Greedy and seeded-sampled tokens of a document and questions over it (the first request
    caches it, compressed with ShadowKV; the others hit it), and the server info."""
    from sglang_shadowkv import Engine

    doc, questions = _document_and_questions()
    with Engine(model_path=path, tp_size=tp_size, check_integrity=True, **flags) as engine:
        outs = [engine.generate(input_ids=doc + questions[0], sampling_params=GREEDY)["output_ids"]]
        outs += [o["output_ids"] for o in engine.generate(input_ids=[doc + q for q in questions[1:]],
                                                          sampling_params=GREEDY)]
        outs.append(engine.generate(input_ids=doc + questions[2], sampling_params=SAMPLED)["output_ids"])
        return outs, engine.get_server_info()


@pytest.fixture(scope="module")
def one_rank(tiny_model_path):
    return {mode: _run(tiny_model_path, 1, flags)[0] for mode, flags in MODES.items()}


@pytest.mark.parametrize("mode", list(MODES))
def test_two_ranks_give_one_ranks_tokens(tiny_model_path, one_rank, mode):
    outs, info = _run(tiny_model_path, 2, MODES[mode])
    assert outs == one_rank[mode]
    assert info["tp_size"] == 2 and [r["rank"] for r in info["ranks"]] == [0, 1]
    assert info["ranks"][0]["weight_bytes"] == info["ranks"][1]["weight_bytes"]
    if mode == "shadowkv":  # each rank compressed its own KV head, and the questions hit the compressed document
        assert info["stats"]["compressions"] == 1 and info["stats"]["compressed_prefix_hits"] >= 3


def test_more_ranks_than_kv_heads_replicate_them(tiny_model_path, one_rank):
    outs, info = _run(tiny_model_path, 4, {})
    assert outs == one_rank["full"] and len(info["ranks"]) == 4


def test_a_model_that_does_not_split_is_refused_naming_what(tiny_model_path):
    from sglang_shadowkv import Engine

    with pytest.raises(ValueError, match="tp_size 3 does not divide the model .*4 attention heads"):
        Engine(model_path=tiny_model_path, tp_size=3)


def test_requests_and_aborts_keep_every_ranks_cache_identical(tiny_model_path):
    """A random workload driven step by step through rank 0's mirrored scheduler (requests sharing
    prefixes, aborts mid-prefill and mid-decode; ShadowKV and a host tier): the integrity check
    compares both ranks' trees and pools each time the scheduler goes idle; a page leaked on one
    rank alone is caught."""
    import random

    from sglang_shadowkv import Engine
    from sglang_shadowkv.sampling_params import SamplingParams

    rng = random.Random(0)
    doc, _ = _document_and_questions()
    with Engine(model_path=tiny_model_path, tp_size=2, check_integrity=True, enable_hierarchical_cache=True,
                **{**SHADOWKV, "max_total_tokens": 2048}) as engine:
        sched = engine.scheduler
        for round_ in range(3):
            rids = []
            for i in range(5):
                prompt = doc[:rng.choice([40, 300, 700])] + [rng.randrange(2, 500) for _ in range(rng.randrange(1, 30))]
                rid = f"r{round_}-{i}"
                sched.add_request(rid, prompt, SamplingParams(max_new_tokens=rng.randrange(1, 12), temperature=0))
                rids.append(rid)
            for step in range(60):
                if not sched.has_work:
                    break
                sched.step()
                if step in (1, 4):
                    sched.abort(rids[step])
            while sched.has_work:
                sched.step()
            sched.run_when_idle()  # raises if a rank's accounting is off or the ranks differ
        assert engine.get_server_info()["stats"]["host_stored_bytes"] > 0
        leaked = sched.scheduler.pool.alloc(1)  # on rank 0 only
        with pytest.raises(RuntimeError, match=r"rank 0: pool accounting is broken.*ranks \[1\] hold a different"):
            sched.run_when_idle()
        sched.scheduler.pool.free(leaked)
        sched.run_when_idle()


def test_the_server_under_tp_serves_refuses_bad_input_survives_an_abort_and_stops_cleanly(tiny_model_path):
    with LiveServer("--model-path", tiny_model_path, "--tp-size", "2", "--check-integrity", *SMALL) as live:
        live.wait_healthy(120)
        body = {"input_ids": [i % 500 + 2 for i in range(600)],
                "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        first = httpx.post(live.url + "/generate", json=body, timeout=60).json()
        assert first["meta_info"]["completion_tokens"] == 8
        bad = httpx.post(live.url + "/generate", json={"input_ids": [5, 100000]}, timeout=60)
        assert bad.status_code == 400 and "input_ids" in bad.json()["message"]
        with httpx.stream("POST", live.url + "/generate", timeout=60, json={
                "input_ids": list(range(9, 300)), "stream": True,
                "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}) as stream:
            for _ in zip(range(3), stream.iter_lines()):
                pass  # leave after a few tokens: the server aborts the request on every rank
        assert_no_pages_held(live.url)
        again = httpx.post(live.url + "/generate", json=body, timeout=60).json()
        assert again["output_ids"] == first["output_ids"]
        info = httpx.get(live.url + "/get_server_info", timeout=60).json()
        assert info["tp_size"] == 2 and len(info["ranks"]) == 2
        processes = live.group()
        assert len(processes) >= 4  # launcher, two ranks, detokenizer
        live.proc.send_signal(signal.SIGTERM)
        assert live.proc.wait(timeout=60) == 0
        wait_until(lambda: not live.group(), 20, "every server process to exit")


def test_a_killed_rank_brings_the_server_down_naming_it(tiny_model_path):
    with LiveServer("--model-path", tiny_model_path, "--tp-size", "2", *SMALL) as live:
        live.wait_healthy(120)
        rank1 = httpx.get(live.url + "/get_server_info", timeout=60).json()["ranks"][1]["pid"]
        os.kill(rank1, signal.SIGKILL)
        assert live.proc.wait(timeout=60) == 3
        assert "the scheduler rank 1 process was killed by SIGKILL" in live.output()
        wait_until(lambda: not live.group(), 20, "every server process to exit")


def test_the_watchdog_ends_a_step_that_never_finishes_naming_the_rank():
    code = ("import time\nfrom sglang_shadowkv.managers.watchdog import StepWatchdog\n"
            "w = StepWatchdog(0.3, 1, report=lambda m: print('reported:', m, flush=True))\n"
            "with w.watch('step'):\n    time.sleep(10)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert done.returncode == 4 and time.monotonic() - started < 8
    assert "reported: rank 1: step did not finish within 0.3 s (--watchdog-timeout)" in done.stdout


def test_the_watchdog_ends_a_call_stuck_holding_the_gil_with_its_stack():
    """A call stuck in C code that never releases the GIL (here a regex that backtracks for ever)
    keeps the watchdog's thread from running: faulthandler's C thread ends the process instead."""
    code = ("import re, time\nfrom sglang_shadowkv.managers.watchdog import StepWatchdog\n"
            "w = StepWatchdog(0.4, 1)\ntime.sleep(0.5)\n"
            "def stuck_in_c():\n    re.match(r'(a+)+$', 'a' * 64 + 'b')\n"
            "with w.watch('step'):\n    stuck_in_c()\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and time.monotonic() - started < 20
    assert "Timeout" in done.stderr and "stuck_in_c" in done.stderr
