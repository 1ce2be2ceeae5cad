"""How much of the true attention a compressed layer keeps: recall of attention mass and output
error, per layer and KV head, with exact attention computed on the side.

Greedy agreement says whether the answers changed, not why. This report separates the two
approximations ShadowKV makes. Low-rank keys: the attention output when every token is attended
but the compressed chunks' keys are rebuilt from A·B. Selection: the share of the exact attention
mass that the attended set (selected chunks + outlier chunks + dense window) holds (its recall),
under each scoring rule on the same queries:
- `mean`: softmax of q · chunk-mean landmark (the paper's);
- `bounds`: softmax of an upper bound of q · k over the chunk's keys from their per-channel minimum
  and maximum (Quest's), which needs two landmarks per chunk instead of one;
- `oracle`: the true attention mass of each chunk: the ceiling any scoring rule can reach.
Every rule goes through the same selection (`selection.select_chunks`) as decode, so the budget
each would choose (adaptive or fixed) is reported beside its recall.
"""

from __future__ import annotations

import torch

from .config import ShadowKVConfig
from .selection import select_chunks

SCORING_RULES = ("mean", "bounds", "oracle")


def bound_logits(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [Q, Hq, D]; lo / hi [n, Hkv, D] per-channel min / max of each chunk's keys -> [Q, Hq, n]:
    the largest q · k any key inside those bounds can give (sum over channels of the larger of
    q·lo and q·hi), scaled."""
    nq, hq, d = q.shape
    hkv = lo.shape[1]
    qg = q.float().view(nq, hkv, hq // hkv, 1, d)
    lo_, hi_ = (x.float().permute(1, 0, 2)[None, :, None] for x in (lo, hi))  # [1, Hkv, 1, n, D]
    return (torch.maximum(qg * lo_, qg * hi_).sum(-1) * sm_scale).reshape(nq, hq, -1)


def group_scores(logits_or_mass: torch.Tensor, hkv: int, selectable: torch.Tensor, softmax: bool) -> torch.Tensor:
    """[Q, Hq, n] per query head -> [Q, Hkv, n] decode's chunk scores: softmax over the selectable
    chunks (when given logits), max over the query heads of each KV group, -1 where not selectable."""
    nq, hq, n = logits_or_mass.shape
    x = logits_or_mass.view(nq, hkv, hq // hkv, n)
    allowed = selectable[None, :, None, :]
    if softmax:
        x = x.masked_fill(~allowed, float("-inf")).softmax(-1)
    return x.amax(2).masked_fill(~selectable[None], -1.0)


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     sm_scale: float) -> torch.Tensor:
    """q [Q, Hq, D] over keys / values [S, Hkv, D] where mask [Q, Hkv or 1, S] allows -> [Q, Hq, D]."""
    nq, hq, d = q.shape
    hkv = keys.shape[1]
    logits = torch.einsum("qhgd,shd->qhgs", q.float().view(nq, hkv, hq // hkv, d), keys.float()) * sm_scale
    logits = logits.masked_fill(~mask[:, :, None], float("-inf"))
    return torch.einsum("qhgs,shd->qhgd", logits.softmax(-1), values.float()).reshape(nq, hq, d)


def chunk_scores(rule: str, q: torch.Tensor, landmarks: torch.Tensor, span_keys: torch.Tensor,
                 chunk_mass: torch.Tensor, selectable: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """[Q, Hkv, n] decode's chunk scores under a scoring rule (see the module docstring):
    landmarks [n, Hkv, D], span_keys [n, c, Hkv, D] the exact keys, chunk_mass [Q, Hq, n]."""
    nq, hq, d = q.shape
    hkv = landmarks.shape[1]
    if rule == "mean":
        logits = torch.einsum("qhgd,nhd->qhgn", q.float().view(nq, hkv, hq // hkv, d), landmarks.float())
        return group_scores(logits.reshape(nq, hq, -1) * sm_scale, hkv, selectable, softmax=True)
    if rule == "bounds":
        return group_scores(bound_logits(q, span_keys.amin(1), span_keys.amax(1), sm_scale), hkv, selectable,
                            softmax=True)
    if rule == "oracle":
        return group_scores(chunk_mass, hkv, selectable, softmax=False)
    raise ValueError(f"rule must be one of {SCORING_RULES}, got {rule!r}")


def layer_report(q: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_held: torch.Tensor, v_held: torch.Tensor, landmarks: torch.Tensor,
                 outliers: torch.Tensor, cfg: ShadowKVConfig, rules=SCORING_RULES) -> dict:
    """One layer of a prompt whose first `span` tokens are compressed.

    q [Q, Hq, D]: post-RoPE queries at `positions` [Q] (each >= span); k, v [S, Hkv, D]: the exact
    keys and values; k_held, v_held [span, Hkv, D]: what ShadowKV holds for the compressed span
    (low-rank keys, stored values; outlier chunks exact); landmarks [n, Hkv, D]: the chunk means
    as stored; outliers [Hkv, o]: outlier chunk ids. Returns per rule the recall per KV head, the
    output error and the chunk counts chosen, and the low-rank-only output error.
    """
    nq, hq, d = q.shape
    span, hkv, _ = k_held.shape
    c, s, dev = cfg.chunk_size, k.shape[0], q.device
    n, group, scale = span // c, hq // hkv, d ** -0.5
    causal = (torch.arange(s, device=dev)[None, :] <= positions[:, None])[:, None]  # [Q, 1, S]
    exact = masked_attention(q, k, v, causal, scale)
    logits = torch.einsum("qhd,shd->qhs", q.float(), k.float().repeat_interleave(group, 1)) * scale
    probs = logits.masked_fill(~causal, float("-inf")).softmax(-1)  # [Q, Hq, S]
    chunk_mass = probs[:, :, :span].reshape(nq, hq, n, c).sum(-1)
    window_mass = probs[:, :, span:].sum(-1)
    k_hat, v_hat = torch.cat([k_held, k[span:]]), torch.cat([v_held, v[span:]])

    def rel_error(mask: torch.Tensor) -> float:
        """Output error of attention over the held keys and values where mask allows."""
        out = masked_attention(q, k_hat, v_hat, mask & causal, scale)
        return float((out - exact).norm() / exact.norm())

    is_outlier = torch.zeros(hkv, n, dtype=torch.bool, device=dev)
    is_outlier.scatter_(1, outliers.long(), True)
    cap = cfg.budget_chunks(n - outliers.shape[1])
    slots = torch.arange(n, device=dev).expand(nq, n)
    budgets = torch.full((nq,), cap, device=dev)
    out = {"lowrank_output_error": rel_error(causal), "window_mass": float(window_mass.mean()), "rules": {}}
    for rule in rules:
        scores = chunk_scores(rule, q, landmarks, k[:span].view(n, c, hkv, d), chunk_mass, ~is_outlier, scale)
        chosen = select_chunks(scores, slots, budgets, cap, cap, cfg.top_p_or_none, cfg.min_budget_chunks)
        attended = is_outlier[None].expand(nq, -1, -1).clone()  # [Q, Hkv, n]
        q_idx, h_idx, col = (chosen >= 0).nonzero(as_tuple=True)
        attended[q_idx, h_idx, chosen[q_idx, h_idx, col]] = True
        held = (chunk_mass * attended.repeat_interleave(group, 1)).sum(-1)  # [Q, Hq]
        recall = (held + window_mass).view(nq, hkv, group).mean((0, 2))
        token_mask = torch.cat([attended.repeat_interleave(c, 2),
                                torch.ones(nq, hkv, s - span, dtype=torch.bool, device=dev)], 2)
        counts = (chosen >= 0).sum(-1).float()  # [Q, Hkv]
        out["rules"][rule] = {"recall_per_head": recall.tolist(), "recall": float(recall.mean()),
                              "output_error": rel_error(token_mask), "chunks_mean": float(counts.mean()),
                              "chunks_p99": float(counts.flatten().quantile(0.99))}
    return out


def summarize(reports: list[dict]) -> dict:
    """Per layer the mean over prompts of every number of their reports (each with "layers" as
    `layer_report` returns them plus the decoder's error and rank), and their means over layers."""
    layers = list(zip(*[rep["layers"] for rep in reports]))  # per layer, one report per prompt

    def per_layer(get) -> list:
        return [sum(get(rep) for rep in reps) / len(reps) for reps in layers]

    def mean(values: list) -> float:
        return sum(values) / len(values)

    out = {"prompts": len(reports),
           "gpu_saving_vs_full": mean([rep["gpu_saving_vs_full"] for rep in reports]),
           "gpu_saving_vs_full_with_bounds": mean([rep["gpu_saving_vs_full_with_bounds"] for rep in reports]),
           "rank_per_layer": per_layer(lambda lay: lay["rank"]),
           "lowrank_output_error_per_layer": per_layer(lambda lay: lay["lowrank_output_error"]),
           "decode_output_error_per_layer": per_layer(lambda lay: lay["decode_output_error"]),
           "rules": {}}
    for key in ("rank", "lowrank_output_error", "decode_output_error"):
        out[key] = mean(out[key + "_per_layer"])
    for rule in layers[0][0]["rules"]:
        stats = {name + "_per_layer": per_layer(lambda lay, name=name: lay["rules"][rule][name])
                 for name in ("recall", "output_error", "chunks_mean", "chunks_p99")}
        stats["recall_per_layer_head"] = [[sum(x) / len(x) for x in zip(*[lay["rules"][rule]["recall_per_head"]
                                                                          for lay in reps])] for reps in layers]
        stats.update(recall=mean(stats["recall_per_layer"]), min_layer_recall=min(stats["recall_per_layer"]),
                     min_head_recall=min(min(heads) for heads in stats["recall_per_layer_head"]),
                     output_error=mean(stats["output_error_per_layer"]), chunks_mean=mean(stats["chunks_mean_per_layer"]))
        out["rules"][rule] = stats
    return out


def format_report(summary: dict) -> str:
    """The summary as a table: per layer the rank, the low-rank keys' output error, and per scoring
    rule the recall of attention mass, chunks chosen (mean / p99) and the output error."""
    rules = list(summary["rules"])
    head = f"{'layer':>5} {'rank':>5} {'lowrank err':>11} " + " ".join(
        f"{rule + ' recall':>14} {'chunks':>9} {'err':>6}" for rule in rules)
    lines = [head]
    for i, rank in enumerate(summary["rank_per_layer"]):
        cells = " ".join(f"{summary['rules'][r]['recall_per_layer'][i]:14.4f} "
                         f"{summary['rules'][r]['chunks_mean_per_layer'][i]:4.0f}/{summary['rules'][r]['chunks_p99_per_layer'][i]:<4.0f} "
                         f"{summary['rules'][r]['output_error_per_layer'][i]:6.3f}" for r in rules)
        lines.append(f"{i:5d} {rank:5.0f} {summary['lowrank_output_error_per_layer'][i]:11.4f} {cells}")
    cells = " ".join(f"{summary['rules'][r]['recall']:14.4f} {summary['rules'][r]['chunks_mean']:4.0f}{'':5} "
                     f"{summary['rules'][r]['output_error']:6.3f}" for r in rules)
    lines.append(f"{'mean':>5} {summary['rank']:5.0f} {summary['lowrank_output_error']:11.4f} {cells}")
    lines.append(f"GPU saving vs full KV: {summary['gpu_saving_vs_full']:.2f}x "
                 f"({summary['gpu_saving_vs_full_with_bounds']:.2f}x with the bound landmarks)")
    return "\n".join(lines)
