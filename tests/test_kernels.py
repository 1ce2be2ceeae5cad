"""Triton kernels against their torch references on fresh random inputs (interpreter on CPU)."""

import pytest
import torch

from sglang_shadowkv.kernels.key_splits import MAX_SPLITS
from sglang_shadowkv.kernels.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the same tests run on the lent GPU


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
    return tuple(t.to(DEVICE) for t in (q, k, v, q_indptr, kv_indptr, kv_indices))


@pytest.mark.parametrize("group", [1, 2, 3, 8])
@pytest.mark.parametrize("head_dim", [32, 48, 64])  # 48: no power of two (Phi-3: 96)
def test_ragged_attention_matches_reference(group, head_dim):
    gen = torch.Generator().manual_seed(group * 100 + head_dim)
    # decode rows, a prefill chunk over a prefix, a whole prompt, lengths not multiples of blocks
    q_lens = [1, 23, 70, 1]
    extra = [130, 41, 0, 2]
    case = _random_case(gen, group, head_dim, q_lens, extra)
    scale = head_dim ** -0.5
    lse_got, lse_want = (torch.full((sum(q_lens), 2 * group), float("nan"), device=DEVICE) for _ in range(2))
    got = ragged_paged_attention(*case, scale, lse=lse_got)
    want = ragged_paged_attention_reference(*case, scale, lse=lse_want)
    tol = 1e-4 if DEVICE == "cpu" else 2e-3  # GPU fp32 dots may use TF32
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(lse_got, lse_want, rtol=tol, atol=tol)


@pytest.mark.parametrize("group", [1, 4, 5])
@pytest.mark.parametrize("splits", [1, 3, 16])
def test_decode_batch_matches_reference_however_its_keys_are_split(group, splits):
    """A decode-only batch (its own kernel): rows of 1 to 300 keys, split more ways than a short
    row has blocks (splits past its end store nothing), with and without the log-sum-exp."""
    gen = torch.Generator().manual_seed(group * 10 + splits)
    q_lens, extra = [1] * 5, [0, 63, 64, 150, 299]
    q, k, v, q_indptr, kv_indptr, kv_indices = _random_case(gen, group, 48, q_lens, extra, pool_slots=600)
    scale = 48 ** -0.5
    lse_got, lse_want = (torch.full((5, 2 * group), float("nan"), device=DEVICE) for _ in range(2))
    args = (q, k, v, q_indptr, kv_indptr, kv_indices, scale)
    got = ragged_paged_attention(*args, max_q_len=1, lse=lse_got, splits=splits)
    want = ragged_paged_attention_reference(*args, lse=lse_want)
    tol = 1e-4 if DEVICE == "cpu" else 2e-3  # GPU fp32 dots may use TF32
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(lse_got, lse_want, rtol=tol, atol=tol)
    torch.testing.assert_close(ragged_paged_attention(*args, max_q_len=1, splits=splits), got)
    with pytest.raises(ValueError, match="splits"):
        ragged_paged_attention(*args, max_q_len=1, splits=MAX_SPLITS + 1)


def test_decode_batches_split_their_keys_to_fill_the_sms(monkeypatch):
    import sglang_shadowkv.kernels.key_splits as ks

    monkeypatch.setattr(ks, "sm_count", lambda device: 132)
    gpu = torch.device("cuda")
    assert ks.decode_key_splits(1, 8, gpu) == 16  # 66 wanted: at most 16
    assert ks.decode_key_splits(8, 8, gpu) == 8  # 9 wanted
    assert ks.decode_key_splits(8, 4, gpu) == 16  # a tensor-parallel rank's 4 KV heads: 17 wanted
    assert ks.decode_key_splits(64, 8, gpu) == 2  # 512 programs: 2 wanted
    assert ks.decode_key_splits(128, 8, gpu) == 1  # 1024 programs fill the SMs four times
    assert ks.decode_key_splits(8, 8, torch.device("cpu")) == 1


def test_reference_is_causal_softmax():
    """The reference itself against a direct dense computation for one request."""
    gen = torch.Generator().manual_seed(7)
    q, k, v, qi, ki, idx = _random_case(gen, 1, 16, [5], [3])
    out = ragged_paged_attention_reference(q, k, v, qi, ki, idx, 0.25)
    kk, vv = k[idx.long()].cpu(), v[idx.long()].cpu()
    q, out = q.cpu(), out.cpu()
    for j in range(5):
        visible = 3 + j + 1
        s = torch.einsum("hd,khd->hk", q[j], kk[:visible]) * 0.25
        want = torch.einsum("hk,khd->hd", s.softmax(-1), vv[:visible])
        torch.testing.assert_close(out[j], want, rtol=1e-5, atol=1e-5)


def test_page_table_matches_slot_layout():
    """ForwardBatch.page_table (FlashInfer's view) lists each request's pages in token order."""
    from sglang_shadowkv.layers.attention import ForwardBatch
    from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool

    page = 4
    pool = PagedKVPool(40, page, 1, 1, 2, torch.float32, "cpu")
    lens = [9, 4, 1, 13]
    page_lists = [pool.alloc(-(-n // page)) for n in lens]
    kv_indices = torch.cat([pool.slots_of_pages(p, n) for p, n in zip(page_lists, lens)]).int()
    kv_indptr = torch.tensor([0] + lens).cumsum(0).int()
    batch = ForwardBatch(torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.arange(5).int(),
                         kv_indptr, kv_indices, [1] * 4, lens)
    indptr, ids, last = batch.page_table(page)
    assert ids.tolist() == [p for pl in page_lists for p in pl]
    assert indptr.tolist() == [0, 3, 4, 5, 9]
    assert last.tolist() == [1, 4, 1, 1]
