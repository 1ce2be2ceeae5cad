"""Next-token choice from a step's logits: greedy, or temperature / top-k / top-p / min-p sampling
after penalties and logit bias. A batch of plain greedy rows takes one argmax."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_shadowkv.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    output_ids: list[int]
    banned_ids: list[int]  # ids that may not be sampled yet (end tokens before min_new_tokens)
    generator: torch.Generator | None


def sample(logits: torch.Tensor, rows: list[SamplingRow], vocab_mask=None, with_logprobs: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's next token [B] and (with_logprobs) its log-probability under the logits before
    penalties and temperature [B], both left on the logits' device: nothing here waits for the
    device. vocab_mask (constrained decoding: an object with apply(logits)) first sets the logits
    of tokens a row's grammar forbids to -inf, in place."""
    if vocab_mask is not None:
        vocab_mask.apply(logits)
    if all(_is_plain_greedy(r) for r in rows):
        tokens = logits.argmax(-1)
    else:
        tokens = torch.stack([_sample_row(logits[i].float(), r) for i, r in enumerate(rows)])
    if not with_logprobs:
        return tokens, None
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def _is_plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return p.is_greedy and not p.has_penalties and not p.logit_bias and not row.banned_ids


def _sample_row(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    p = row.params
    logits = logits.clone()
    if p.logit_bias:
        for token, bias in p.logit_bias.items():
            logits[int(token)] += float(bias)
    if p.has_penalties and row.output_ids:
        ids, counts = torch.tensor(row.output_ids, device=logits.device).unique(return_counts=True)
        seen = logits[ids]
        if p.repetition_penalty != 1.0:
            seen = torch.where(seen > 0, seen / p.repetition_penalty, seen * p.repetition_penalty)
        seen = seen - p.frequency_penalty * counts - p.presence_penalty
        logits[ids] = seen
    if row.banned_ids:
        logits[row.banned_ids] = float("-inf")
    if p.is_greedy:
        return logits.argmax()
    logits = logits / p.temperature
    if p.top_k > 0:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cut = sorted_probs.cumsum(0) - sorted_probs >= p.top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(cut, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return torch.multinomial(probs / probs.sum(), 1, generator=row.generator).squeeze(0)
