"""Prefill of a suffix over a compressed prefix, without bringing the prefix back dense.

A question over a cached document, or a chat's next turn, prefills a short suffix that attends to
the whole compressed document. Per layer and request, its attention is split in two parts merged
by log-sum-exp (exact: softmax over the union of disjoint key sets):
- the compressed chunks, read the way decode reads them: per tile of TILE suffix queries, the
  landmark softmax mass summed over the tile's queries (max over each KV group) picks the budget's
  best chunks per KV head; their keys are rebuilt and values fetched into the request's own
  chunk-cache scratch, and the tile's queries attend them and the outlier chunks exactly (one
  matmul per KV head: the tile's queries share those keys). A tile
  per 64 queries (not one selection for the whole suffix, as the ShadowKV reference does) lets a
  long question that touches several parts of the document find them all. An `exact` request
  (a suffix longer than shadowkv_sparse_prefill_max, or one that asks for prompt logprobs)
  attends every chunk instead, streamed through the scratch a scratch-full at a time: never the
  whole document dense at once.
- the dense tokens: the prefix's dense spans and the suffix itself, causally (the ragged prefill
  kernel; the dense tokens are the last of that key list, so its causal rule holds).
The scratch ends holding the last tile's selection: the request's decode starts from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import ragged_paged_attention as rpa
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool, ReqToTokenPool, to_device

from .decode import SparseDecoder
from .request_state import CompressedLayout, pad_outliers

TILE = 64  # suffix queries that share one chunk selection


@dataclass
class SuffixRequest:
    table_row: int
    scratch_row: int
    layout: CompressedLayout
    start: int  # first token of this step's chunk of the suffix
    seq_len: int  # tokens including this step's
    exact: bool


@dataclass
class SuffixPlan:
    """What every layer needs for one request's suffix chunk."""
    req: SuffixRequest
    q_rows: tuple[int, int]  # the chunk's rows of the step's queries
    rows: torch.Tensor  # [1] int32 scratch row
    chunk_slots: torch.Tensor  # [1, N] int32
    outliers: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # [1, Hkv, O] blocks, lo, hi
    budgets: torch.Tensor  # [1]
    top_k: int
    dense_indptr: torch.Tensor  # [2] int32 over dense_slots
    dense_slots: torch.Tensor  # slots of the dense spans, then of [compressed_end, seq_len)
    q_indptr: torch.Tensor  # [2] int32


class SuffixPrefill:
    def __init__(self, decoder: SparseDecoder, use_triton: bool):
        self.decoder, self.use_triton = decoder, use_triton

    def plan(self, table: ReqToTokenPool, req: SuffixRequest, q_rows: tuple[int, int]) -> SuffixPlan:
        dev, lay = self.decoder.pool.device, req.layout
        spans = [*lay.dense_spans, (lay.compressed_end, req.seq_len)]
        dense_slots = table.span_slots(*map(list, zip(*[(req.table_row, a, b) for a, b in spans])))
        n_dense = sum(b - a for a, b in spans)
        budget = self.decoder.cfg.budget_chunks(lay.num_chunks - lay.num_outliers)
        ints = dict(dtype=torch.int32)
        return SuffixPlan(
            req, q_rows, torch.tensor([req.scratch_row], **ints, device=dev), lay.chunk_slots.int()[None],
            pad_outliers([lay], self.decoder.pool.num_kv_heads, dev),
            torch.tensor([budget], device=dev), budget,
            to_device(torch.tensor([0, n_dense], **ints), dev), dense_slots,
            to_device(torch.tensor([0, q_rows[1] - q_rows[0]], **ints), dev))

    def attend(self, q: torch.Tensor, layer: int, plan: SuffixPlan, kv_pool: PagedKVPool) -> torch.Tensor:
        """q [T, Hq, D]: the chunk's queries -> their attention output [T, Hq, D]."""
        dense_out, dense_lse = self._dense(q, layer, plan, kv_pool)
        decoder = self.decoder
        outliers = decoder.live_outliers(layer, *plan.outliers)
        pieces = self._exact_pieces(layer, plan) if plan.req.exact else None
        out = torch.empty_like(q)
        for t0 in range(0, q.shape[0], q.shape[0] if pieces is not None else TILE):
            qt = q[t0:t0 + TILE] if pieces is None else q
            o, lse = dense_out[t0:t0 + qt.shape[0]].float(), dense_lse[t0:t0 + qt.shape[0]]
            for k, selected in enumerate(pieces if pieces is not None else [self._select(qt, layer, plan)]):
                entries = decoder.fetch_selected(layer, plan.rows, selected)
                first = k == 0  # outliers once, with the first piece
                part, part_lse = self._compressed(qt, layer, outliers if first else torch.full_like(outliers, -1),
                                                  plan.req.scratch_row, entries)
                o, lse = merge(o, lse, part, part_lse)
            out[t0:t0 + qt.shape[0]] = o.to(q.dtype)
        return out

    def _select(self, qt: torch.Tensor, layer: int, plan: SuffixPlan) -> torch.Tensor:
        """[1, Hkv, max_entries] the tile's chunks: landmark mass summed over its queries."""
        t, h = qt.shape[0], self.decoder.pool.num_kv_heads
        slots = plan.chunk_slots.expand(t, -1).contiguous()
        logits = self.decoder.landmark_logits(qt, layer, slots).view(t, h, -1, slots.shape[1])
        mass = logits.softmax(-1).amax(2).sum(0)
        mass = mass.masked_fill(logits[0, :, 0].isinf(), -1.0)
        return self.decoder.select(mass[None], plan.chunk_slots, plan.budgets, plan.top_k)

    def _exact_pieces(self, layer: int, plan: SuffixPlan) -> list[torch.Tensor]:
        """Every selectable chunk, as [1, Hkv, max_entries] pieces that fit the scratch."""
        decoder = self.decoder
        slots = plan.chunk_slots[0].long()
        ok = decoder.pool.selectable[layer][slots].T.bool()  # [Hkv, N]
        per_head = torch.where(ok, slots, -1)
        size = decoder.max_entries
        pieces = []
        for a in range(0, slots.numel(), size):
            piece = per_head[:, a:a + size]
            pieces.append(torch.nn.functional.pad(piece, (0, size - piece.shape[1]), value=-1)[None])
        return pieces

    def _compressed(self, qt: torch.Tensor, layer: int, outliers: torch.Tensor, row: int,
                    entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of the tile's queries [t, Hq, D] over the outliers [1, Hkv, O] and the scratch
        entries [1, Hkv, K] of one request: (output [t, Hq, D] float32, lse [t, Hq]). The queries
        share their keys, so each KV head's keys are gathered once and scored as one matmul."""
        decoder, pool = self.decoder, self.decoder.pool
        t, hq, d = qt.shape
        h, c = pool.num_kv_heads, pool.chunk_size
        heads = torch.arange(h, device=qt.device)[:, None]

        def gather(blocks_k, blocks_v, ids):  # ids [Hkv, n] (-1: none) -> keys/values [Hkv, n * c, D], valid
            safe = ids.clamp(min=0).long()
            valid = (ids >= 0)[:, :, None].expand(-1, -1, c).reshape(h, -1)
            return blocks_k(safe).reshape(h, -1, d), blocks_v(safe).reshape(h, -1, d), valid

        ok, ov, o_valid = gather(lambda i: pool.outlier_k[layer][i], lambda i: pool.outlier_v[layer][i], outliers[0])
        sk, sv, s_valid = gather(lambda i: decoder.scratch_k[layer][row][heads, i],
                                 lambda i: decoder.scratch_v[layer][row][heads, i], entries[0])
        keys, values = torch.cat([ok, sk], 1).float(), torch.cat([ov, sv], 1).float()
        valid = torch.cat([o_valid, s_valid], 1)
        q = qt.float().view(t, h, hq // h, d).permute(1, 0, 2, 3).reshape(h, -1, d)  # [Hkv, t * G, D]
        scores = (q @ keys.transpose(1, 2) * d ** -0.5).masked_fill(~valid[:, None, :], float("-inf"))
        lse = scores.logsumexp(-1)  # [Hkv, t * G]; -inf where a head has no keys
        probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
        out = (probs @ values).view(h, t, hq // h, d).permute(1, 0, 2, 3).reshape(t, hq, d)
        return out, lse.view(h, t, hq // h).permute(1, 0, 2).reshape(t, hq)

    def _dense(self, q, layer, plan, kv_pool):
        lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        fn = rpa.ragged_paged_attention if self.use_triton else rpa.ragged_paged_attention_reference
        out = fn(q, kv_pool.k_buffers[layer], kv_pool.v_buffers[layer], plan.q_indptr, plan.dense_indptr,
                 plan.dense_slots, q.shape[-1] ** -0.5, lse=lse)
        return out, lse


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor):
    """Attention over the union of two disjoint key sets from each set's output [T, H, D] and
    log-sum-exp [T, H] (float32; a set with no keys has lse -inf and contributes nothing)."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    out = (o1 * w1[..., None] + o2 * w2[..., None]) / total[..., None]
    return out, m + torch.log(total)
