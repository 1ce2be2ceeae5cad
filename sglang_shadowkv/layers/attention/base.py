"""The attention-backend interface and the per-step batch description it reads.

A backend stores each layer's new keys and values into the KV pool and returns attention of the
step's queries over everything the requests have cached. Full attention backends read the dense
pool; the ShadowKV backend plugs in behind the same two calls.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool, ReqToTokenPool, to_device


@dataclass
class ForwardBatch:
    """One model step: each request brings its new tokens (a prefill chunk or one decode token)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T] pool slots receiving the new tokens' K/V
    q_indptr: torch.Tensor  # [B+1] int32, new tokens per request
    # [B+1] int32 cached + new tokens per request, and [sum kv] int32 slots of each request's tokens
    # in order (None in a graph step until the backend's begin_graph_step fills what it reads)
    kv_indptr: torch.Tensor | None
    kv_indices: torch.Tensor | None
    extend_lens: list[int]
    seq_lens: list[int]
    pool_rows: list[int] | None = None  # each request's row of the request-to-token table
    shadowkv: list | None = None  # each request's ShadowKVReqState (None: plain dense request)
    prompt_lens: list | None = None  # each request's prompt length (None: not tracked)
    cached_lens: list | None = None  # each request's prompt tokens supplied by the radix cache

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens)

    def page_table(self, page_size: int, device: torch.device | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's KV as pages (FlashInfer's layout): page_indptr [B+1] and last_page_len [B]
        on the host, page_ids on the device.

        A request's token i lives on its page i // page_size at offset i % page_size, so its page
        ids are the slots of every page_size-th token divided by page_size.
        """
        seq_lens = torch.tensor(self.seq_lens, dtype=torch.int64)
        pages = (seq_lens + page_size - 1) // page_size
        page_indptr = torch.zeros(len(self.seq_lens) + 1, dtype=torch.int32)
        page_indptr[1:] = pages.cumsum(0)
        kv_starts = torch.cumsum(seq_lens, 0) - seq_lens  # the host's copy of kv_indptr
        starts = torch.repeat_interleave(kv_starts, pages)
        within = torch.arange(int(pages.sum())) - torch.repeat_interleave(page_indptr[:-1].long(), pages)
        first_slots = to_device(starts + within * page_size, self.kv_indices.device)
        page_ids = (self.kv_indices.long()[first_slots] // page_size).int()
        last_page_len = (seq_lens - (pages - 1) * page_size).int()
        return page_indptr, page_ids, last_page_len

    def subset(self, requests: list[int]) -> tuple["ForwardBatch", torch.Tensor]:
        """The step restricted to some requests, and the rows of their tokens in the full step."""
        q_starts = [0] + list(itertools.accumulate(self.extend_lens))
        kv_starts = [0] + list(itertools.accumulate(self.seq_lens))
        token_rows = torch.cat([torch.arange(q_starts[i], q_starts[i + 1]) for i in requests])
        kv_rows = torch.cat([torch.arange(kv_starts[i], kv_starts[i + 1]) for i in requests])
        extend = [self.extend_lens[i] for i in requests]
        seq = [self.seq_lens[i] for i in requests]
        dev = self.q_indptr.device
        token_rows, kv_rows = to_device(token_rows, dev), to_device(kv_rows, self.kv_indices.device)

        def indptr(lens):
            return to_device(torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32), dev)

        sub = ForwardBatch(
            input_ids=self.input_ids[token_rows], positions=self.positions[token_rows],
            out_cache_loc=self.out_cache_loc[token_rows.to(self.out_cache_loc.device)],
            q_indptr=indptr(extend), kv_indptr=indptr(seq), kv_indices=self.kv_indices[kv_rows],
            extend_lens=extend, seq_lens=seq,
            pool_rows=None if self.pool_rows is None else [self.pool_rows[i] for i in requests],
            prompt_lens=None if self.prompt_lens is None else [self.prompt_lens[i] for i in requests],
            cached_lens=None if self.cached_lens is None else [self.cached_lens[i] for i in requests])
        return sub, token_rows

    @property
    def last_token_index(self) -> torch.Tensor:
        """Index of each request's last new token in the flattened step."""
        return (self.q_indptr[1:] - 1).long()


class AttentionBackend(ABC):
    """Per step: `begin_step` plans (once for all layers), then `forward` per layer.

    Decode steps can also run from fixed buffers, so that a CUDA graph captured once replays them
    (SGLang's init_forward_metadata_capture/replay_cuda_graph): `init_graph_state` allocates the
    buffers, `begin_graph_step` writes a step's metadata into them for a batch padded to a
    captured size, and `attend` then reads only those buffers. `graph_variants` lists what, beside
    the batch size, fixes a graph's shapes (one graph per batch size and variant).
    """

    supports_graphs = True
    capturable = True  # False: its decode steps read host copies of the metadata, so graphs run them eagerly

    def __init__(self, pool: PagedKVPool, num_heads: int, head_dim: int):
        self.pool = pool
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.sm_scale = head_dim ** -0.5

    def begin_step(self, batch: ForwardBatch) -> None:
        """Per-step planning shared by all layers (index building, kernel plans)."""

    def init_graph_state(self, max_bs: int, max_kv_tokens: int, req_to_token: ReqToTokenPool) -> None:
        """Fixed metadata buffers for decode batches of up to max_bs requests holding up to
        max_kv_tokens tokens in all (their slots are read from req_to_token's rows)."""
        dev = self.pool.device
        self._req_to_token = req_to_token
        self._graph_kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
        self._graph_kv_indices = torch.zeros(max_kv_tokens, dtype=torch.int32, device=dev)

    def graph_variants(self) -> list:
        """The shape variants a graph may have per batch size."""
        return [None]

    def startup_graph_variants(self) -> list:
        """The variants captured at startup; the others are captured on first use."""
        return self.graph_variants()

    def compile_graph_variants(self) -> list:
        """Variants run once eagerly at startup (not captured) so that the kernels every variant
        needs are compiled before the first request, where capturing them all would cost time
        and memory for graphs serving may never replay (default: none)."""
        return []

    def compile_variant(self, variant):
        """The variant whose compiled kernels this one's steps launch (graphs of the two need one
        warmup between them); by default itself."""
        return variant

    def compile_suffix_variants(self) -> list:
        """The same for suffix graph variants (`suffix_graph_variant`; default: none)."""
        return []

    def graph_variant(self, batch: ForwardBatch):
        """The captured variant a padded decode batch replays with (NO_GRAPH: run it eagerly)."""
        return None if sum(batch.seq_lens) <= self._graph_kv_indices.numel() else NO_GRAPH

    def graph_parts(self, items: list) -> bool:
        """Whether a step mixing prompt chunks with decodes should run its decodes (and short
        suffixes) from their graphs and only the rest eagerly. Dense backends: no, a mixed step is
        one eager pass (decode tokens ride along with the prompt chunk's GEMMs for free)."""
        return False

    def suffix_graph_variant(self, batch: ForwardBatch):
        """The variant a graph batch of prompt chunks, each padded in place (cuda_graph_runner's
        suffix step), replays with; dense backends run prompt chunks eagerly (NO_GRAPH)."""
        return NO_GRAPH

    def begin_graph_step(self, batch: ForwardBatch, variant) -> None:
        """Write a padded decode batch's metadata into the fixed buffers and point the batch at
        them (default: the ragged kv_indptr / kv_indices the dense kernels read)."""
        self.fill_graph_kv(batch)
        self.begin_step(batch)

    def fill_graph_kv(self, batch: ForwardBatch) -> None:
        """batch.kv_indptr / kv_indices: every token's slot, in the fixed buffers."""
        seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32)
        indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
        indptr[1:] = seq_lens.cumsum(0)
        total = int(indptr[-1])
        self._graph_kv_indptr[:len(indptr)].copy_(to_device(indptr, self.pool.device), non_blocking=True)
        self._graph_kv_indices[:total].copy_(
            self._req_to_token.span_slots(batch.pool_rows, [0] * len(seq_lens), batch.seq_lens))
        batch.kv_indptr = self._graph_kv_indptr[:len(indptr)]
        batch.kv_indices = self._graph_kv_indices

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                batch: ForwardBatch) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (post-RoPE) -> attention output [T, Hq, D]."""
        self.pool.set_kv(layer, batch.out_cache_loc, k, v)
        return self.attend(q, layer, batch)

    @abstractmethod
    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        ...


NO_GRAPH = object()  # graph_variant's answer for a batch the captured graphs cannot hold
