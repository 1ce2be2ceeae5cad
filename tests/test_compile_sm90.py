"""The decode path's Triton kernels (and compression's value quantization) compile for the H100 (sm_90) with the server's types: a bf16
pool, Llama-3.1-8B's heads and ShadowKV's default rank. The interpreter runs the other kernel tests;
it accepts code the compiler rejects, and the lent GPU found that only after a device call."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import sys
sys.path.insert(0, "maintainers/lent_gpu")
import torch
from compile_sm90 import compile_only
from sglang_shadowkv.kernels.chunk_cache_plan import plan_chunk_cache_in_place
from sglang_shadowkv.kernels.chunk_selection import select_decode_chunks
from sglang_shadowkv.kernels.gather_values import gather_values
from sglang_shadowkv.kernels.landmark_scores import landmark_logits
from sglang_shadowkv.kernels.quantize_chunks import quantize_chunks
from sglang_shadowkv.kernels.ragged_paged_attention import ragged_paged_attention
from sglang_shadowkv.kernels.rebuild_keys import rebuild_keys
from sglang_shadowkv.kernels.sparse_decode_attention import sparse_decode_attention
from sglang_shadowkv.layers.rotary import RotaryEmbedding
from sglang_shadowkv.mem_cache.compressed_pool import ShadowKVPool
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool

chunk, hkv, head_dim, rank, group, batch, entries = 8, 8, 128, 160, 4, 3, 7
kv = PagedKVPool(64, chunk, 1, hkv, head_dim, torch.bfloat16, "cpu")
store = ShadowKVPool(kv, rank, host_chunks=100, max_segments=8)
seg = store.alloc_segment(0, 17 * chunk, 1)
rotary = RotaryEmbedding(head_dim, 500000.0, 2048)
slots = seg.chunk_slots[torch.randint(0, 17, (batch, hkv, entries))]  # int64, as the chunk-cache plan hands them
table = torch.tensor(kv.alloc(8), dtype=torch.int32).view(2, 4)
rows = torch.tensor([0, 1, 0], dtype=torch.int32)
values = ShadowKVPool(PagedKVPool(64, chunk, 1, hkv, head_dim, torch.bfloat16, "cpu"), rank, host_chunks=100,
                      max_segments=8, value_dtype=torch.int8, landmark_dtype=torch.int8)  # the GPU's default
value_seg = values.alloc_segment(0, 17 * chunk, 1)
value_jobs = value_seg.chunk_slots[torch.randint(0, 17, (batch, hkv, entries))]
value_table = torch.tensor(values.kv.alloc(8), dtype=torch.int32).view(2, 4)
chunk_slots = value_seg.chunk_slots[:17].int().expand(batch, -1).contiguous()
with compile_only() as compiled:
    for splits in (1, 3):  # the dense decode step (full attention's, and ShadowKV's dense rows)
        ragged_paged_attention(torch.randn(batch, hkv * group, head_dim).bfloat16(), kv.k_buffers[0],
                               kv.v_buffers[0], torch.arange(batch + 1, dtype=torch.int32),
                               torch.tensor([0, 5, 40, 41], dtype=torch.int32), torch.arange(41, dtype=torch.int32),
                               head_dim ** -0.5, max_q_len=1, splits=splits)
    quantize_chunks(torch.randn(17 * chunk, hkv + 1, head_dim).bfloat16()[:, :hkv], chunk)  # compression's values
    for live in (None, torch.tensor([2], dtype=torch.int32)):  # an eager step, a CUDA graph's padded one
        q = torch.randn(batch, hkv * group, head_dim).bfloat16()
        logits = landmark_logits(q, values.landmarks[0], chunk_slots, values.selectable[0], head_dim ** -0.5,
                                 values.landmark_scale[0], live)
        selected = select_decode_chunks(logits, hkv, chunk_slots, torch.full((batch,), 6), 6, entries, 0.9, 2,
                                        torch.zeros(2, 1, entries + 1, dtype=torch.long), rows, 0, live)
        plan_chunk_cache_in_place(torch.full((2, hkv, entries), -1), rows, selected, live,
                                  torch.zeros(2, 2, dtype=torch.long))  # (counting hits, as decode steps do)
        for jobs in (value_jobs, value_jobs.int()):  # decode's int64, and int32 (the device refused them once)
            gather_values(values.host_v[0], values.host_slot, jobs, values.blocks_v[0], value_table, rows,
                          values.value_scale[0], values.resident(0), live, programs=4)
        for jobs in (slots, slots.int()):
            rebuild_keys(store.a_lo[0], store.a_hi[0], *store.basis_memory(0), rotary.cos_cache, rotary.sin_cache,
                         store.chunk_pos, store.chunk_basis, jobs, store.blocks_k[0], table, rows,
                         store.basis_rank[0], live)
        for queries in (1, 32) if live is None else (1,):  # a decode step, a suffix's tile (never padded)
            q = torch.randn(batch * queries, hkv * group, head_dim).bfloat16()
            for splits in (1, 3):
                sparse_decode_attention(q, store.blocks_k[0], store.blocks_v[0],
                                        torch.full((batch, hkv, 2), -1, dtype=torch.int32), table, rows,
                                        torch.arange(entries, dtype=torch.int32).expand(batch, hkv, -1).contiguous(),
                                        torch.randn(40, hkv, head_dim).bfloat16(),
                                        torch.randn(40, hkv, head_dim).bfloat16(),
                                        torch.tensor([0, 3, 3, 10], dtype=torch.int32),
                                        torch.arange(10, dtype=torch.int32), head_dim ** -0.5,
                                        queries_per_request=queries, splits=splits, live=live)
print(" ".join(sorted(set(compiled))))
"""


def test_decode_kernels_compile_for_sm90_with_the_servers_types():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["_decode_kernel", "_gather_values_kernel", "_landmark_logits_kernel", "_merge_splits_kernel",
                                    "_plan_kernel", "_quantize_chunks_kernel", "_rebuild_keys_kernel",
                                    "_select_kernel", "_sparse_decode_kernel"]
