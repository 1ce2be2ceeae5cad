"""Sampling parameter validation and the sampler's behaviour."""

import pytest
import torch

from sglang_shadowkv.layers.sampler import SamplingRow, sample
from sglang_shadowkv.sampling_params import SamplingParams


@pytest.mark.parametrize("params, field", [
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"max_new_tokens": 1.5}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"bogus": 1}, "bogus"),
    ({"regex": "[a-"}, "regex"),
    ({"json_schema": '{"type": 5}'}, "json_schema"),
    ({"ebnf": "root ::= "}, "ebnf"),
    ({"regex": "a+", "ebnf": 'root ::= "a"'}, "at most one"),
    ({"stop_regex": "x+"}, "stop_regex"),
    ({"n": 0}, "n"),
])
def test_bad_params_name_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_dict(params)


def test_defaults_and_normalization():
    sp = SamplingParams.from_dict({"stop": "END", "stop_token_ids": 5, "json_schema": None})
    assert sp.stop == ["END"] and sp.stop_token_ids == [5] and sp.max_new_tokens == 128


def _tokens(logits, rows):
    return sample(logits, rows)[0].tolist()


def _rows(n, **kw):
    sp = SamplingParams.from_dict(kw)
    return [SamplingRow(sp, [], [], torch.Generator().manual_seed(i)) for i in range(n)]


def test_greedy_and_top_k_one_pick_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    want = logits.argmax(-1).tolist()
    assert _tokens(logits, _rows(6, temperature=0)) == want
    assert _tokens(logits, _rows(6, temperature=1.3, top_k=1)) == want
    assert _tokens(logits, _rows(6, temperature=1.0, top_p=1e-6)) == want


def test_top_k_restricts_support_and_seed_reproduces():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(2))
    top3 = set(logits[0].topk(3).indices.tolist())
    draws = [_tokens(logits, _rows(1, temperature=2.0, top_k=3))[0] for _ in range(30)]
    assert set(draws) <= top3
    a = [_tokens(logits, _rows(1, temperature=1.0))[0] for _ in range(5)]
    b = [_tokens(logits, _rows(1, temperature=1.0))[0] for _ in range(5)]
    assert a == b  # same generator seed, same draw


def test_penalty_and_ban_move_the_choice():
    logits = torch.zeros(1, 10)
    logits[0, 4] = 1.0
    sp = SamplingParams.from_dict({"temperature": 0, "presence_penalty": 2.0})
    assert _tokens(logits, [SamplingRow(sp, [4], [], None)]) != [4]
    sp = SamplingParams.from_dict({"temperature": 0})
    assert _tokens(logits, [SamplingRow(sp, [], [4], None)]) != [4]


def test_logprob_is_of_unmodified_distribution():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(3))
    tokens, lps = (t.tolist() for t in sample(logits, _rows(2, temperature=0)))
    ref = torch.log_softmax(logits, -1)
    assert lps == pytest.approx([ref[i, t].item() for i, t in enumerate(tokens)], abs=1e-6)
