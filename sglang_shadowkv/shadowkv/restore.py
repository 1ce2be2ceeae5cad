"""Dense keys and values of compressed chunks, for prefilling a suffix after a compressed prefix.

A request that reuses a compressed document still has to prefill its own suffix (a question, a new
chat turn), and the suffix attends to the whole prefix. Its chunks are brought back dense: keys
RoPE(A·B) at their positions, values copied from the host pool; outlier chunks exactly, keys and
values from the outlier pool (exact even when the host values are int8). Then the suffix runs
ordinary dense prefill attention over them.
"""

from __future__ import annotations

import torch

from sglang_shadowkv.layers.rotary import RotaryEmbedding
from sglang_shadowkv.mem_cache.shadow_pool import ChunkRef, ShadowKVPool


def restore_chunks(pool: ShadowKVPool, refs: list[ChunkRef], layer: int,
                   rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys (post-RoPE) and values [len(refs) * c, Hkv, D] of consecutive chunk references."""
    c, h, d = pool.chunk_size, pool.num_kv_heads, pool.head_dim
    keys, values = [], []
    for seg, indices in _runs_by_segment(refs):
        idx = torch.tensor(indices, device=pool.device)
        slots = seg.chunk_slots[idx]
        offsets = torch.arange(c, device=pool.device)
        rows = (slots[:, None] * c + offsets).flatten()
        rank = seg.ranks[layer]
        k_pre = pool.a_rows[layer][rows, :rank].float() @ pool.basis[layer][seg.seg_id, :rank].float()
        positions = (seg.start + idx[:, None] * c + offsets).flatten()
        k = rotary.apply(k_pre.view(-1, h, d), positions, out_dtype=pool.dtype)
        v = pool.read_host_values(layer, seg, indices[0], len(indices)).permute(0, 2, 1, 3).reshape(-1, h, d)
        # outlier chunks of this run: their exact keys and values
        blocks = seg.outlier_blocks.long()  # [H, o]
        first = pool.outlier_pos[layer][blocks] - seg.start - indices[0] * c  # offset in this run
        inside = (first >= 0) & (first < len(indices) * c)
        head, which = inside.nonzero(as_tuple=True)
        if head.numel():
            token = (first[head, which][:, None] + offsets).flatten()
            token_heads = (token, head.repeat_interleave(c))
            k[token_heads] = pool.outlier_k[layer][blocks[head, which]].reshape(-1, d)
            v[token_heads] = pool.outlier_v[layer][blocks[head, which]].reshape(-1, d)
        keys.append(k)
        values.append(v)
    return torch.cat(keys), torch.cat(values)


def _runs_by_segment(refs: list[ChunkRef]):
    """(segment, consecutive chunk indices) runs of a list of references."""
    runs: list[tuple] = []
    for ref in refs:
        if runs and runs[-1][0] is ref.segment and runs[-1][1][-1] + 1 == ref.index:
            runs[-1][1].append(ref.index)
        else:
            runs.append((ref.segment, [ref.index]))
    return runs
