"""Which compressed chunks a query attends: chunk scores -> a fixed-width set of chunks per KV head.

Two budgets (DESIGN.md §2, decode step 2). Fixed: every KV head takes its `budget` best chunks
(the paper's top-k). Adaptive (top-p, the idea of Twilight applied to chunk landmarks): each KV head
takes the smallest set of best chunks whose share of the score mass reaches `top_p`, between a
floor and the cap. A model that attends sharply then reads few chunks, one that spreads its
attention reads many, per step, layer and KV head. The result is always `width` columns wide
(-1 past each head's count), so the shapes a CUDA graph captured never change.

Scores are non-negative where a chunk can be chosen (softmax probabilities, max over the query
heads of a KV group, maybe summed over queries) and negative where it cannot (outlier chunks,
padding); the mass of a head is the sum of its non-negative scores.
"""

from __future__ import annotations

import torch


def chunk_counts(sorted_scores: torch.Tensor, total: torch.Tensor, budgets: torch.Tensor,
                 top_p: float | None, floor: int) -> torch.Tensor:
    """Chunks each KV head takes: sorted_scores [R, H, K] its K best scores, descending; total
    [R, H, 1] the mass of all its chunks; budgets [R] the most each request may take (<= K).
    top_p None: exactly the budget; otherwise the least count whose mass reaches top_p of the
    total, clipped to [min(floor, budget), budget]."""
    cap = budgets[:, None].expand(sorted_scores.shape[:2])
    if top_p is None:
        return cap
    mass = sorted_scores.clamp(min=0)
    # chunk j is needed while the mass of the chunks before it is still short of the target
    needed = ((mass.cumsum(-1) - mass) < top_p * total).sum(-1)
    return torch.minimum(torch.maximum(needed, cap.clamp(max=floor)), cap)


def select_chunks(scores: torch.Tensor, chunk_slots: torch.Tensor, budgets: torch.Tensor, top_k: int,
                  width: int, top_p: float | None = None, floor: int = 0) -> torch.Tensor:
    """scores [R, H, N] -> chunk slots [R, H, width] each KV head attends (best first, -1 padded).

    chunk_slots [R, N] names the chunk of each score column; budgets [R] the most chunks per KV head
    of each request; top_k >= every budget, the columns actually ranked (static for CUDA graphs);
    width >= top_k, the output columns. top_p / floor: the adaptive budget (see `chunk_counts`).
    """
    r, h = scores.shape[:2]
    top = scores.topk(top_k, dim=-1)  # sorted, best first
    total = None if top_p is None else scores.clamp(min=0).sum(-1, keepdim=True)
    counts = chunk_counts(top.values, total, budgets, top_p, floor)
    selected = chunk_slots.long().gather(1, top.indices.view(r, -1)).view(r, h, top_k)
    keep = torch.arange(top_k, device=scores.device) < counts[..., None]
    selected = torch.where(keep, selected, -1)
    return torch.nn.functional.pad(selected, (0, width - top_k), value=-1)


def select_chunks_reference(scores: torch.Tensor, chunk_slots: torch.Tensor, budgets: torch.Tensor,
                            top_p: float | None, floor: int) -> list[list[set[int]]]:
    """The same choice, one KV head at a time in plain Python: the set of chunk slots per (R, H)."""
    out = []
    for r in range(scores.shape[0]):
        row = []
        for h in range(scores.shape[1]):
            order = sorted(range(scores.shape[2]), key=lambda j: -float(scores[r, h, j]))
            budget = int(budgets[r])
            ranked = order[:budget] if top_p is None else order
            count = budget
            if top_p is not None:
                best = [max(0.0, float(scores[r, h, j])) for j in order[:budget]]
                total = sum(max(0.0, float(x)) for x in scores[r, h])
                acc, count = 0.0, 0
                while count < budget and acc < top_p * total:
                    acc += best[count]
                    count += 1
                count = max(count, min(floor, budget))
            row.append({int(chunk_slots[r, j]) for j in ranked[:count]})
        out.append(row)
    return out


def budget_summary(hist: torch.Tensor, cap: int) -> dict:
    """hist [layers, cap + 1]: KV-head steps that selected k chunks -> mean and p99 per layer, and
    over all layers a cumulative histogram (steps selecting at most `le` chunks, le = 16, 32, ... cap)."""
    steps = hist.sum(1)
    k = torch.arange(hist.shape[1], dtype=torch.float64)
    mean = (hist.double() * k).sum(1) / steps.clamp(min=1)
    cdf = hist.cumsum(1).double() / steps.clamp(min=1)[:, None]
    p99 = (cdf < 0.99).sum(1).clamp(max=cap)
    edges = sorted({*(2 ** i for i in range(4, cap.bit_length()) if 2 ** i < cap), cap})
    at_most = hist.sum(0).cumsum(0)
    return {"mean_chunks_per_layer": [round(x, 2) for x in mean.tolist()], "p99_chunks_per_layer": p99.tolist(),
            "mean_chunks": float((hist.double() * k).sum() / steps.sum().clamp(min=1)), "max_chunks": cap,
            "head_steps": int(steps.sum()),
            "histogram": {"le": edges, "head_steps": [int(at_most[e]) for e in edges]}}
