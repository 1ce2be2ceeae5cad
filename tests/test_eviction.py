"""The KV-eviction baselines (StreamingLLM, SnapKV): what they keep, that attention sees exactly
that, and that eviction survives in the radix cache for later turns."""

import pytest
import torch

from sglang_shadowkv.layers.attention import ForwardBatch
from sglang_shadowkv.layers.attention.eviction_backend import (
    EvictionAttentionBackend, SnapKVPolicy, StreamingLLMPolicy)
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool
from sglang_shadowkv.server_args import ServerArgs
from tests.conftest import assert_pool_clean

HQ, HKV, D = 4, 2, 16


def step(backend, q, k, v, start, prompt_len, cached_len=0):
    """One request whose tokens start..start+len(q) live at slots of the same numbers."""
    n = q.shape[0]
    seq = start + n
    batch = ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.long), positions=torch.arange(start, seq),
        out_cache_loc=torch.arange(start, seq), q_indptr=torch.tensor([0, n], dtype=torch.int32),
        kv_indptr=torch.tensor([0, seq], dtype=torch.int32), kv_indices=torch.arange(seq, dtype=torch.int32),
        extend_lens=[n], seq_lens=[seq], prompt_lens=[prompt_len], cached_lens=[cached_len])
    backend.begin_step(batch)
    return backend.forward(q, k, v, 0, batch)


def attention_over(q, k, v, visible):
    """One query [HQ, D] over the keys each KV head may see (visible [len, HKV]), plain softmax."""
    out = torch.empty_like(q)
    for h in range(HQ):
        rows = visible[:, h // (HQ // HKV)]
        p = (k[rows, h // (HQ // HKV)] @ q[h] * D ** -0.5).softmax(0)
        out[h] = p @ v[rows, h // (HQ // HKV)]
    return out


def make_backend(policy, tokens=512):
    pool = PagedKVPool(tokens // 8, 8, 1, HKV, D, torch.float32, "cpu")
    return EvictionAttentionBackend(pool, HQ, D, policy)


def test_streamingllm_keeps_sinks_and_recent_window_then_rolls():
    gen = torch.Generator().manual_seed(1)
    L, budget, sinks = 100, 20, 4
    backend = make_backend(StreamingLLMPolicy(budget, sinks))
    q, k, v = (torch.randn(L + 2, h, D, generator=gen) for h in (HQ, HKV, HKV))
    step(backend, q[:L], k[:L], v[:L], 0, L)  # the prompt: exact attention, then eviction
    visible = ~backend.hidden[0][:L]
    expect = torch.zeros(L, dtype=torch.bool)
    expect[:sinks] = True
    expect[L - (budget - sinks):] = True
    assert torch.equal(visible, expect[:, None].expand(L, HKV))
    for pos in (L, L + 1):  # each decode token sees the kept tokens and itself, then the window rolls
        out = step(backend, q[pos:pos + 1], k[pos:pos + 1], v[pos:pos + 1], pos, L)
        seen = torch.zeros(pos + 1, dtype=torch.bool)
        seen[:sinks] = True
        seen[pos - (budget - sinks):] = True
        torch.testing.assert_close(out[0], attention_over(q[pos], k[:pos + 1], v[:pos + 1],
                                                          seen[:, None].expand(pos + 1, HKV)))
    assert int((~backend.hidden[0][:L + 2, 0]).sum()) == budget


def test_snapkv_keeps_what_the_observation_window_attends_to_per_kv_head():
    gen = torch.Generator().manual_seed(2)
    L, budget, window = 200, 40, 8
    backend = make_backend(SnapKVPolicy(budget, window))
    q, k, v = (torch.randn(L + 1, h, D, generator=gen) for h in (HQ, HKV, HKV))
    look = q[L - window:L, :HQ // HKV].mean((0, 1))
    k[37, 0] = 8 * look / look.norm()  # KV head 0's window looks here ...
    k[28:47, 1] = -8 * look / look.norm()  # ... and head 1's away from here
    step(backend, q[:L], k[:L], v[:L], 0, L)
    visible = ~backend.hidden[0][:L]
    assert visible[L - window:].all()  # the window stays
    assert visible[:L - window].sum(0).tolist() == [budget - window] * HKV  # top-k per KV head
    assert visible[34:41, 0].all()  # 37 and its neighbours (max-pooling over 7 tokens)
    assert not visible[31:44, 1].any()
    assert not torch.equal(visible[:, 0], visible[:, 1])  # heads choose separately
    out = step(backend, q[L:], k[L:], v[L:], L, L)
    seen = torch.cat([visible, torch.ones(1, HKV, dtype=torch.bool)])
    torch.testing.assert_close(out[0], attention_over(q[L], k, v, seen))


def test_snapkv_eviction_is_permanent_and_leaves_later_short_turns_alone():
    gen = torch.Generator().manual_seed(3)
    L, extra, budget = 200, 30, 40
    backend = make_backend(SnapKVPolicy(budget, 8))
    q, k, v = (torch.randn(L + extra, h, D, generator=gen) for h in (HQ, HKV, HKV))
    step(backend, q[:L], k[:L], v[:L], 0, L)
    before = backend.hidden[0][:L].clone()
    # a later turn reuses the first L tokens from the cache and prefills 30 more (< budget)
    step(backend, q[L:], k[L:], v[L:], L, L + extra, cached_len=L)
    assert torch.equal(backend.hidden[0][:L], before)
    assert not backend.hidden[0][L:L + extra].any()


@pytest.mark.parametrize("kwargs,needle", [
    (dict(attention="snapkv", attention_backend="triton"), "attention_backend"),
    (dict(attention="snapkv", eviction_budget=16, snapkv_window=32), "snapkv_window"),
    (dict(attention="streamingllm", streamingllm_sinks=0), "streamingllm_sinks"),
    (dict(attention="h2o"), "attention"),
])
def test_eviction_arguments_are_checked(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ServerArgs(**kwargs)


@pytest.fixture(scope="module")
def snapkv_engine():
    from sglang_shadowkv import Engine

    eng = Engine(attention="snapkv", eviction_budget=96, snapkv_window=16, max_total_tokens=4096,
                 chunked_prefill_size=256)
    yield eng
    eng.shutdown()


def test_snapkv_engine_evicts_once_and_later_turns_reuse_the_evicted_prefix(snapkv_engine, engine):
    eng = snapkv_engine
    text = " ".join(f"Item {i} is stored on shelf {i % 7}." for i in range(60)) + " Which shelf holds item 12?"
    greedy = {"max_new_tokens": 8, "temperature": 0}
    first = eng.generate(text, greedy)
    backend = eng.scheduler.runner.backend
    hidden_after_first = sum(int(h.sum()) for h in backend.hidden)
    prompt_len = first["meta_info"]["prompt_tokens"]
    layers, kv_heads = len(backend.hidden), backend.hidden[0].shape[1]
    assert hidden_after_first == layers * kv_heads * (prompt_len - 96)  # each head kept 96 tokens
    turn2 = text + first["text"] + " And item 13?"
    second = eng.generate(turn2, greedy)
    assert second["meta_info"]["cached_tokens"] >= prompt_len - 8
    assert sum(int(h.sum()) for h in backend.hidden) == hidden_after_first  # nothing more, nothing back
    # with a budget above the prompt, SnapKV is full attention
    eng.flush_cache()
    assert_pool_clean(eng)
    short = "Item 3 is stored on shelf 3. Which shelf holds item 3?"
    assert eng.generate(short, greedy)["output_ids"] == engine.generate(short, greedy)["output_ids"]
