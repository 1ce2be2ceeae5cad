"""Shared fixtures. Triton kernels run under the interpreter when there is no GPU."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: the workers share the cores, one each
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def engine():
    """The embedded model with dense attention, shared by the CPU end-to-end tests."""
    from sglang_shadowkv import Engine

    eng = Engine(max_total_tokens=16384, chunked_prefill_size=512, check_integrity=True)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def hf_model(engine):
    """The same model in transformers (float32): the independent reference."""
    from transformers import AutoModelForCausalLM

    path = engine.get_server_info()["model_path"]
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def assert_pool_clean(engine) -> None:
    """Every page (and ShadowKV segment, host slot, scratch row) is either free or held by the radix
    tree: nothing leaked to dead requests."""
    from sglang_shadowkv.testing.live_server import pool_leaks

    info = engine.get_server_info()
    mem = info["memory"]
    assert mem["running_request_pages"] == 0 and mem["reserved_pages"] == 0
    assert not any(pool_leaks(info).values()), pool_leaks(info)
    assert mem["evictable_pages"] == mem["tree_pages"]


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory) -> str:
    """A tiny random Llama with a 4K context (loads in a second; decodes a few hundred tokens/s)."""
    from tiny_model import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def server():
    """The embedded model behind HTTP at default flags (CPU-sized pools; the pool accounting
    checked whenever it goes idle), shared by the server and SGLang-compatibility tests: each
    checks what it changed, never absolute counters."""
    from sglang_shadowkv.testing.live_server import servers

    with servers(["--check-integrity"]) as (url,):
        yield url


@pytest.fixture(scope="session")
def small_server():
    """The embedded model behind HTTP with metrics on and a 64-token context (room for the chat
    template), so that any request the server accepts ends within seconds (fuzzing, metrics)."""
    from sglang_shadowkv.testing.live_server import LiveServer

    with LiveServer("--enable-metrics", "--context-length", "64", "--max-total-tokens", "4096",
                    "--check-integrity") as live:
        yield live
