"""Chunk selection (fixed and adaptive budgets), bound scores, the selection report and the budget
summaries (CPU, random inputs against plain references)."""

import pytest
import torch

from sglang_shadowkv.shadowkv.config import ShadowKVConfig
from sglang_shadowkv.shadowkv.selection import budget_summary, select_chunks, select_chunks_reference
from sglang_shadowkv.shadowkv.selection_report import bound_logits, format_report, layer_report


def random_scores(gen, r, h, n, sharp: float):
    """Softmax-like scores (-1 for unselectable chunks, as decode marks outliers and padding)."""
    scores = (sharp * torch.randn(r, h, n, generator=gen)).softmax(-1)
    return scores.masked_fill(torch.rand(r, h, n, generator=gen) < 0.2, -1.0)


@pytest.mark.parametrize("top_p", [None, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("sharp", [0.5, 4.0])
def test_selection_matches_the_reference(top_p, sharp):
    gen = torch.Generator().manual_seed(int(sharp * 10) + int(100 * (top_p or 0)))
    r, h, n, width = 5, 3, 40, 24
    scores = random_scores(gen, r, h, n, sharp)
    chunk_slots = torch.randperm(1000, generator=gen)[:r * n].view(r, n) + 1
    budgets = torch.tensor([20, 3, 16, 1, 12])
    got = select_chunks(scores, chunk_slots, budgets, 20, width, top_p, floor=4)
    assert got.shape == (r, h, width)
    want = select_chunks_reference(scores, chunk_slots, budgets, top_p, floor=4)
    for i in range(r):
        for j in range(h):
            row = got[i, j].tolist()
            count = sum(x >= 0 for x in row)
            assert row[count:] == [-1] * (width - count)  # chosen chunks first, then padding
            assert set(row[:count]) == want[i][j]
            if top_p is None:
                assert count == budgets[i]
            else:
                assert min(4, budgets[i]) <= count <= budgets[i]


def test_adaptive_budget_follows_how_spread_the_scores_are():
    gen = torch.Generator().manual_seed(0)
    sharp = torch.zeros(1, 1, 100)
    sharp[0, 0, 7] = 0.97
    sharp[0, 0, 8:11] = 0.01
    flat = torch.full((1, 1, 100), 0.01)
    budgets = torch.tensor([64])
    slots = torch.arange(100)[None]
    pick = select_chunks(sharp, slots, budgets, 64, 64, top_p=0.98, floor=2)
    assert sorted(x for x in pick[0, 0].tolist() if x >= 0) == [7, 8]  # 0.97 + 0.01 reaches 0.98
    pick = select_chunks(flat, slots, budgets, 64, 64, top_p=0.5, floor=2)
    assert (pick[0, 0] >= 0).sum() == 50
    pick = select_chunks(flat, slots, budgets, 64, 64, top_p=0.9, floor=2)
    assert (pick[0, 0] >= 0).sum() == 64  # the cap
    noise = torch.rand(1, 1, 100, generator=gen)
    assert (select_chunks(noise, slots, budgets, 64, 64, top_p=1e-6, floor=5)[0, 0] >= 0).sum() == 5  # the floor


def test_bound_logits_bound_every_key_of_the_chunk():
    gen = torch.Generator().manual_seed(1)
    n, c, hkv, group, d = 6, 8, 2, 3, 16
    keys = torch.randn(n, c, hkv, d, generator=gen)
    q = torch.randn(4, hkv * group, d, generator=gen)
    got = bound_logits(q, keys.amin(1), keys.amax(1), 0.25)  # [Q, Hq, n]
    for h in range(hkv * group):
        dots = torch.einsum("qd,ncd->qnc", q[:, h], keys[:, :, h // group]) * 0.25
        assert (got[:, h] >= dots.amax(-1) - 1e-5).all()  # an upper bound of every key's logit
        want = torch.tensor([[sum(max(float(q[i, h, x] * keys[j, :, h // group, x].min()),
                                      float(q[i, h, x] * keys[j, :, h // group, x].max()))
                                  for x in range(d)) * 0.25 for j in range(n)] for i in range(4)])
        torch.testing.assert_close(got[:, h], want, atol=1e-4, rtol=1e-4)
    one_key = keys[:, :1]  # lo == hi: the bound is the key's own logit
    torch.testing.assert_close(bound_logits(q, one_key.amin(1), one_key.amax(1), 1.0),
                               torch.einsum("qhd,nhd->qhn", q, one_key[:, 0].repeat_interleave(group, 1)))


def report_inputs(gen, s=160, c=8, hkv=2, group=2, d=16, nq=4):
    k = torch.randn(s, hkv, d, generator=gen)
    k[40:48] *= 4  # one chunk that attention favours
    v = torch.randn(s, hkv, d, generator=gen)
    q = torch.randn(nq, hkv * group, d, generator=gen)
    return q, torch.arange(s - nq, s), k, v


def test_selection_report_recall_and_errors():
    gen = torch.Generator().manual_seed(2)
    q, pos, k, v = report_inputs(gen)
    span, c = 128, 8
    n = span // c
    landmarks = k[:span].view(n, c, 2, 16).mean(1)
    outliers = torch.tensor([[0], [0]])
    everything = ShadowKVConfig(budget=1.0, min_budget_chunks=1, chunk_size=c)
    rep = layer_report(q, pos, k, v, k[:span], v[:span], landmarks, outliers, everything)
    assert rep["lowrank_output_error"] < 1e-5  # exact keys held
    for rule in ("mean", "bounds", "oracle"):  # all chunks attended: exact attention
        assert rep["rules"][rule]["recall"] == pytest.approx(1.0, abs=1e-5)
        assert rep["rules"][rule]["output_error"] < 1e-5 and rep["rules"][rule]["chunks_mean"] == n - 1
    few = ShadowKVConfig(budget=0.01, min_budget_chunks=2, chunk_size=c)
    noisy = k[:span] + 0.5 * torch.randn(span, 2, 16, generator=gen)
    rep = layer_report(q, pos, k, v, noisy, v[:span], landmarks, outliers, few)
    recalls = {rule: rep["rules"][rule]["recall"] for rule in ("mean", "bounds", "oracle")}
    assert recalls["oracle"] >= max(recalls["mean"], recalls["bounds"]) - 1e-6  # the ceiling
    assert all(0 < r < 1 for r in recalls.values()) and rep["rules"]["mean"]["chunks_mean"] == 2
    assert rep["lowrank_output_error"] > 0.01
    # recall by hand for the oracle: window + outlier + the two chunks of most mass (per KV head, max over group)
    logits = torch.einsum("qhd,shd->qhs", q, k.repeat_interleave(2, 1)) / 4
    probs = logits.masked_fill(torch.arange(160) > pos[:, None, None], float("-inf")).softmax(-1)  # causal
    mass = probs[:, :, :span].reshape(4, 4, n, c).sum(-1)
    scores = mass.view(4, 2, 2, n).amax(2)
    scores[:, :, 0] = -1
    top = scores.topk(2, -1).indices.repeat_interleave(2, 1)
    held = mass.gather(2, top).sum(-1) + mass[:, :, 0] + probs[:, :, span:].sum(-1)
    assert recalls["oracle"] == pytest.approx(float(held.mean()), abs=1e-5)


def test_budget_summary_mean_p99_and_histogram():
    gen = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 33, (3, 500), generator=gen)
    counts[1] = 7
    hist = torch.zeros(3, 33, dtype=torch.int64)
    hist.scatter_add_(1, counts, torch.ones_like(counts))
    got = budget_summary(hist, 32)
    torch.testing.assert_close(torch.tensor(got["mean_chunks_per_layer"]), counts.float().mean(1), atol=0.01, rtol=0)
    want_p99 = [int(sorted(row)[int(0.99 * 500) - 1]) for row in counts.tolist()]  # the 495th of 500
    assert got["p99_chunks_per_layer"] == want_p99 and got["p99_chunks_per_layer"][1] == 7
    assert got["head_steps"] == 1500 and got["max_chunks"] == 32
    flat = counts.flatten()
    assert got["histogram"] == {"le": [16, 32], "head_steps": [int((flat <= 16).sum()), 1500]}


def test_budget_counting_is_per_row_layer_and_head():
    """The decoder's histogram (scatter_add_ on the device, safe inside a CUDA graph) against plain
    counting: padding rows (the dummy row) land only in their own row."""
    from sglang_shadowkv.kernels.chunk_selection import count_budgets

    gen = torch.Generator().manual_seed(4)
    rows_n, layers, width, h = 4, 3, 10, 2
    hist = torch.zeros(rows_n + 1, layers, width + 1, dtype=torch.int64)
    want = torch.zeros_like(hist)
    for step in range(20):
        rows = torch.randint(0, rows_n + 1, (3,), generator=gen, dtype=torch.int32)
        counts = torch.randint(0, width + 1, (3, h), generator=gen)
        selected = torch.where(torch.arange(width) < counts[..., None], 7, -1)
        layer = step % layers
        count_budgets(hist, rows, layer, selected)
        for r, row_counts in zip(rows.tolist(), counts.tolist()):
            for c in row_counts:
                want[r, layer, c] += 1
    assert torch.equal(hist, want)


def test_budget_and_rank_settings():
    cfg = ShadowKVConfig()
    assert cfg.budget == "auto" and cfg.top_p_or_none == cfg.top_p and cfg.energy == cfg.rank_energy
    assert cfg.budget_chunks(10_000) == cfg.max_budget and cfg.budget_chunks(20) == 20
    assert ShadowKVConfig(budget="0.5").budget == 0.5  # a command-line flag's text
    fixed = ShadowKVConfig(rank=64, budget=0.1, min_budget_chunks=4)
    assert fixed.energy is None and fixed.top_p_or_none is None and fixed.max_rank(1024) == 64
    assert fixed.budget_chunks(20) == 4 and fixed.budget_chunks(100) == 10
    assert ShadowKVConfig(rank_cap=48).max_rank(192) == 48 and ShadowKVConfig(rank_cap=512).max_rank(192) == 192
    for kwargs, name in [({"budget": "most"}, "shadowkv_budget"), ({"top_p": 0.0}, "shadowkv_top_p"),
                         ({"max_budget": 0}, "shadowkv_max_budget"),
                         ({"rank_cap": 0}, "shadowkv_rank_cap"), ({"rank_energy": None}, "shadowkv_rank_energy")]:
        with pytest.raises(ValueError, match=name):
            ShadowKVConfig(**kwargs)


def test_engine_report_agrees_with_the_decode_path(engine):
    """Engine.shadowkv_report on the embedded model: its emulated attention over the attended set
    is the decoder's own step (same selection, keys and values) for the last query."""
    from tests.test_shadowkv import long_prompt

    ids = long_prompt(engine.tokenizer, 800, 7)
    # one prefill for both; spans to the last chunk (span grid 8): the default grid's 512 tokens of
    # 800 leave 32 chunks past the outliers, the budget's floor, so every one is selected
    rep, fixed = engine.shadowkv_report(input_ids=ids, num_queries=1, settings=[
        {"min_context": 512, "span_grid": 8}, {"min_context": 512, "span_grid": 8, "rank": 32, "budget": 0.05}])
    assert rep["compressed_tokens"] == (800 - 64) // 8 * 8 and len(rep["layers"]) == 30
    assert all(1 <= r <= 160 for r in rep["ranks"]) and len(set(rep["ranks"])) > 1  # the energy rule, per layer
    for lay in rep["layers"]:
        assert lay["rules"]["mean"]["output_error"] == pytest.approx(lay["decode_output_error"], abs=2e-4)
        assert lay["lowrank_output_error"] <= lay["rules"]["mean"]["output_error"] + 1e-3
        assert 0 < lay["rules"]["mean"]["recall"] <= lay["rules"]["oracle"]["recall"] + 0.02 <= 1.02
    summary = rep["summary"]
    assert summary["rank_per_layer"] == rep["ranks"] and rep["gpu_saving_vs_full"] > rep["gpu_saving_vs_full_with_bounds"]
    assert set(summary["rules"]) == {"mean", "bounds", "oracle"} and "recall" in format_report(summary)
    assert fixed["ranks"] == [32] * 30 and fixed["summary"]["lowrank_output_error"] > summary["lowrank_output_error"]
    assert fixed["summary"]["rules"]["oracle"]["chunks_mean"] == 32  # the floor: 5% of 92 chunks is less
