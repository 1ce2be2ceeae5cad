"""Tensor-parallel layers: each rank holds a slice of a weight and the collectives join them.

- ColumnParallelLinear: a slice of the output features (QKV heads, gate/up columns); no
  communication, its outputs stay split.
- RowParallelLinear: the matching slice of the input features (o_proj, down_proj); each rank's
  partial product is summed over ranks by an all-reduce.
- VocabParallelEmbedding: a slice of the vocabulary's rows; a rank looks up the ids it holds,
  zeros for the rest, and an all-reduce sums them.
- ParallelLMHead: the same vocabulary slice as logits; an all-gather joins them.

Each knows which slice of the checkpoint's full tensor is its own (`shard`), so loading reads only
that slice. With one rank they are plain nn.Linear / nn.Embedding with no collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_shadowkv.distributed.parallel_state import get_tp


def vocab_shard_size(vocab_size: int, tp_size: int) -> int:
    """Rows of the vocabulary per rank: the vocabulary padded up to a multiple of the ranks."""
    return -(-vocab_size // tp_size)


class ColumnParallelLinear(nn.Linear):
    """Output features (heads of q, k or v; MLP columns) split across ranks: a rank holds its
    consecutive share. `replicas` > 1: there are fewer slices than ranks (KV heads when the TP size
    exceeds their count), so each slice serves that many consecutive ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, replicas: int = 1):
        tp = get_tp()
        self.tp_rank, self.tp_size, self.replicas = tp.rank, tp.size, replicas
        slices = tp.size // replicas
        if out_features % slices:
            raise ValueError(f"{out_features} output features do not split across {slices} ranks")
        super().__init__(in_features, out_features // slices, bias=bias)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        n = self.out_features
        return full.narrow(0, (self.tp_rank // self.replicas) * n, n)


class RowParallelLinear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        tp = get_tp()
        self.tp, self.tp_rank = tp, tp.rank
        if in_features % tp.size:
            raise ValueError(f"{in_features} input features do not split across {tp.size} ranks")
        super().__init__(in_features // tp.size, out_features, bias=bias)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        if full.dim() == 1:  # a bias is added once, after the sum: None, zeros on the other ranks
            return full.narrow(0, 0, full.shape[0]) if self.tp_rank == 0 else None
        n = self.in_features
        return full.narrow(1, self.tp_rank * n, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class _VocabParallel(nn.Module):
    """Rows [start, start + rows) of a [vocab, hidden] weight: the vocabulary padded to a multiple
    of the ranks, split in order."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        tp = get_tp()
        self.tp, self.vocab_size = tp, vocab_size
        self.rows = vocab_shard_size(vocab_size, tp.size)
        self.start = tp.rank * self.rows
        # from the checkpoint: no random init (nn.Embedding's normal_ on the meta device imports
        # torch._dynamo, 2-3 s of every start)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """As far as the vocabulary goes (the loader leaves the last slice's padding rows zero)."""
        return full.narrow(0, self.start, max(0, min(self.rows, full.shape[0] - self.start)))


class VocabParallelEmbedding(_VocabParallel):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0))


class ParallelLMHead(_VocabParallel):
    """Logits of the whole vocabulary on every rank (sampling runs on each), from each rank's
    slice of the rows; may share its weight with the embedding (tied)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last_dim(logits)[..., :self.vocab_size]
