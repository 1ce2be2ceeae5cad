"""Triton kernels against their torch references on fresh random inputs (interpreter on CPU)."""

import pytest
import torch

from kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference


def _random_case(gen, group, head_dim, q_lens, extra_kv, pool_slots=512, dtype=torch.float32):
    num_kv = 2
    kv_lens = [q + e for q, e in zip(q_lens, extra_kv)]
    q = torch.randn(sum(q_lens), num_kv * group, head_dim, generator=gen, dtype=dtype)
    k = torch.randn(pool_slots, num_kv, head_dim, generator=gen, dtype=dtype)
    v = torch.randn(pool_slots, num_kv, head_dim, generator=gen, dtype=dtype)
    q_indptr = torch.tensor([0] + q_lens).cumsum(0).int()
    kv_indptr = torch.tensor([0] + kv_lens).cumsum(0).int()
    kv_indices = torch.randperm(pool_slots, generator=gen)[:sum(kv_lens)].int() if sum(kv_lens) <= pool_slots \
        else torch.randint(0, pool_slots, (sum(kv_lens),), generator=gen).int()
    return q, k, v, q_indptr, kv_indptr, kv_indices


@pytest.mark.parametrize("group", [1, 2, 3, 8])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_ragged_attention_matches_reference(group, head_dim):
    gen = torch.Generator().manual_seed(group * 100 + head_dim)
    # decode rows, a prefill chunk over a prefix, a whole prompt, lengths not multiples of blocks
    q_lens = [1, 23, 70, 1]
    extra = [130, 41, 0, 2]
    case = _random_case(gen, group, head_dim, q_lens, extra)
    scale = head_dim ** -0.5
    got = ragged_paged_attention(*case, scale)
    want = ragged_paged_attention_reference(*case, scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_reference_is_causal_softmax():
    """The reference itself against a direct dense computation for one request."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, qi, ki, idx = _random_case(gen, 1, 16, [5], [3])
    out = ragged_paged_attention_reference(q, k, v, qi, ki, idx, 0.25)
    kk, vv = k[idx.long()], v[idx.long()]
    for j in range(5):
        visible = 3 + j + 1
        s = torch.einsum("hd,khd->hk", q[j], kk[:visible]) * 0.25
        want = torch.einsum("hk,khd->hd", s.softmax(-1), vv[:visible])
        torch.testing.assert_close(out[j], want, rtol=1e-5, atol=1e-5)


def test_rejects_non_power_of_two_head_dim():
    gen = torch.Generator().manual_seed(0)
    case = _random_case(gen, 1, 24, [2], [0])
    with pytest.raises(ValueError, match="head_dim"):
        ragged_paged_attention(*case, 0.2)
