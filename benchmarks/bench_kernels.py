"""ShadowKV kernels and one decode layer on the GPU, side by side with their physical limits.

Llama-3.1-8B-shaped attention (32 query heads, 8 KV heads, head dim 128, bf16), chunk 8, rank 160,
48 outliers, 256 selected chunks per KV head (the paper's defaults):
  1. value gather from pinned host memory (UVA) against a pinned host-to-device copy, same run;
  2. key rebuild hidden behind the value gather (two streams): overlap ratio;
  3. one decode layer: ShadowKV (scores, top-k, chunk cache, rebuild + fetch, sparse attention;
     timed as a CUDA-graph replay, as the server runs it: eagerly its ~30 launches would time the
     host) against full attention (FlashInfer decode if importable, else the Triton paged kernel;
     one or two launches, eagerly) at 32K and 128K context, batch 1..48, values on the GPU or in
     host memory, values and landmarks stored as served (int8 on a GPU), with the chunk-cache hit
     rate of drifting or independent queries, each kernel's device time, and both paths against
     their floors (their least bytes over the HBM and PCIe bandwidths measured in the same run);
  4. the sparse attention kernel alone, its keys split among programs or not (decode batches and
     suffix tiles);
  5. prefill compression of one layer against the dense prefill of that layer (32K, 128K), and
     eigh-vs-SVD agreement of the reconstructed keys; a 32-layer segment's compression at the
     defaults (bases of all layers solved in one batch) against 32 dense layers.
Segments are made by the engine's compression (compress_layer) from random keys and values, in a
compressed pool inside a one-layer dense pool of their own (mem_cache/compressed_pool.py).
Prints one table per part; writes JSON to $OUT/bench_kernels.json (or --out).

    python benchmarks/bench_kernels.py            # on the GPU
    python benchmarks/bench_kernels.py --smoke    # tiny sizes, any device (checks the script runs; on a
                                                  # CPU torch references stand in for the decode kernels)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # --smoke on a CPU: the Triton kernels timed there run under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sglang_shadowkv.kernels import gather_values as gv  # noqa: E402
from sglang_shadowkv.kernels.gather_values import gather_values, gather_values_reference  # noqa: E402
from sglang_shadowkv.kernels.ragged_paged_attention import (  # noqa: E402
    ragged_paged_attention, ragged_paged_attention_reference)
from sglang_shadowkv.kernels.rebuild_keys import rebuild_keys, rebuild_keys_reference  # noqa: E402
from sglang_shadowkv.layers.rotary import RotaryEmbedding  # noqa: E402
from sglang_shadowkv.mem_cache.compressed_layout import (  # noqa: E402
    element_size, segment_pages, slot_layout, values_per_page)
from sglang_shadowkv.mem_cache.compressed_pool import Segment, ShadowKVPool  # noqa: E402
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool, ReqToTokenPool  # noqa: E402
from sglang_shadowkv.shadowkv.compress import SegmentCompression, compress_layer, low_rank_basis  # noqa: E402
from sglang_shadowkv.shadowkv.config import ShadowKVConfig  # noqa: E402
from sglang_shadowkv.shadowkv.decode import SparseDecoder, SparseRequest  # noqa: E402
from sglang_shadowkv.shadowkv.request_state import segment_layout  # noqa: E402

HQ, HKV, D, CHUNK, RANK, LAYERS = 32, 8, 128, 8, 160, 32
CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
DT = torch.bfloat16 if CUDA else torch.float32


PARTS = ("bandwidth", "compression", "decode_layer", "key_splits")


def timeit(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() (CUDA events on the GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def segment_store(num_segments: int, tokens: int, outliers: int, scratch_pages: int, layers: int = 1,
                  storage: torch.dtype = DT, spare_pages: int = 0) -> tuple[ShadowKVPool, list[Segment]]:
    """A compressed pool (one layer unless told) inside a dense pool of its own, just big enough for
    num_segments segments of `tokens` tokens (from position 0), allocated, scratch_pages pages of
    chunk-cache scratch and spare_pages more (GPU values); values and landmarks stored as `storage`."""
    n = tokens // CHUNK
    layout = slot_layout(CHUNK, HKV, D, RANK, DT, storage, storage)
    pages = (num_segments * segment_pages(layout, n, outliers, RANK, CHUNK) + scratch_pages + spare_pages
             + 2)  # + page 0, null page
    store = ShadowKVPool(PagedKVPool(pages, CHUNK, layers, HKV, D, DT, DEV), RANK, num_segments * n, num_segments,
                         value_dtype=storage, landmark_dtype=storage)
    return store, [store.alloc_segment(0, tokens, outliers) for _ in range(num_segments)]


def random_segments(num_segments: int, tokens: int, cfg: ShadowKVConfig, rotary: RotaryEmbedding,
                    gen: torch.Generator, scratch_pages: int, values_on_gpu: bool = False,
                    storage: torch.dtype = DT) -> tuple[ShadowKVPool, list[Segment]]:
    """segment_store's segments, each compressed as the engine does (compress_layer, cfg's rank and
    outliers) from i.i.d. random keys and values; values_on_gpu: each also given its GPU values, as
    the server does while memory allows (else they are read from pinned host memory)."""
    n = tokens // CHUNK
    spare = num_segments * -(-n // values_per_page(DT, storage)) if values_on_gpu else 0
    store, segs = segment_store(num_segments, tokens, cfg.num_outliers(n), scratch_pages, storage=storage,
                                spare_pages=spare)
    for seg in segs:
        k, v = (torch.randn(tokens, HKV, D, dtype=DT, device=DEV, generator=gen) for _ in range(2))
        compress_layer(store, seg, 0, k, v, rotary, cfg)
    store.wait_host_writes()
    if values_on_gpu:
        def never(pages: int) -> None:
            raise RuntimeError(f"the bench's pool is {pages} pages short: it holds exactly what it lends")

        store.kv.reclaim = never  # lending needs a hook; spare_pages leaves nothing to reclaim
        if not all(store.load_values(seg) for seg in segs):
            raise RuntimeError("the bench's pool has too few pages for the segments' GPU values")
    return store, segs


# ---- 1 + 2: gather bandwidth and rebuild overlap ---------------------------------------------------
def bandwidth_and_overlap(num_slots: int, batch: int, entries: int) -> dict:
    """On a CPU the torch references stand in for the two kernels, as in the decoder (under the
    interpreter one key rebuild of the smoke's jobs takes ~20 s)."""
    rebuild_fn = rebuild_keys if CUDA else rebuild_keys_reference
    rotary = RotaryEmbedding(D, 500000.0, num_slots * CHUNK).to(DEV)
    store, (seg,) = random_segments(1, num_slots * CHUNK, ShadowKVConfig(rank=RANK), rotary,
                                    torch.Generator(device=DEV).manual_seed(0), batch * entries)
    host = store.host_v[0]  # pinned on a GPU
    gen = torch.Generator().manual_seed(0)
    jobs = torch.stack([seg.chunk_slots[torch.randperm(num_slots, generator=gen)[:entries].to(DEV)]
                        for _ in range(batch * HKV)]).view(batch, HKV, entries)
    rows = torch.arange(batch, dtype=torch.int32, device=DEV)  # scratch rows: `entries` pool pages each
    scratch_pages = torch.tensor(store.kv.alloc(batch * entries), dtype=torch.int32, device=DEV).view(batch, entries)
    blocks_k, blocks_v = store.blocks_k[0], store.blocks_v[0]
    moved = jobs.numel() * CHUNK * D * host.element_size()
    dst = torch.empty(moved // host.element_size(), dtype=DT, device=DEV)
    src = host.view(-1)[:dst.numel()]
    t_copy = timeit(lambda: dst.copy_(src, non_blocking=True))
    # key rebuild of the same jobs, alone and concurrent with the gather on a second stream

    def rebuild():
        rebuild_fn(store.a_lo[0], store.a_hi[0], *store.basis_memory(0), rotary.cos_cache, rotary.sin_cache,
                   store.chunk_pos, store.chunk_basis, jobs, blocks_k, scratch_pages, rows, store.basis_rank[0])

    t_rebuild = timeit(rebuild)
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count if CUDA else 1
    grids = []
    for programs in (sms // 2, sms, 2 * sms, 4 * sms, 8 * sms, 16 * sms):
        def gather():
            if CUDA:
                gather_values(host, store.host_slot, jobs, blocks_v, scratch_pages, rows, programs=programs)
            else:
                gather_values_reference(host, store.host_slot, jobs, blocks_v, scratch_pages, rows)

        t_gather, t_both = timeit(gather), timeit(on_two_streams(gather, rebuild))
        grids.append({"programs": programs, "gather_GBps": moved / t_gather / 1e9,
                      "gather_vs_copy": t_copy / t_gather, "gather_ms": t_gather * 1e3,
                      "both_two_streams_ms": t_both * 1e3,
                      "rebuild_hidden_fraction": max(0.0, min(1.0, (t_rebuild + t_gather - t_both) / t_rebuild))})
    blocks_v.fill_(0)
    (gather_values if CUDA else gather_values_reference)(host, store.host_slot, jobs, blocks_v, scratch_pages, rows)
    entry = blocks_v[scratch_pages[1, 5].item() * HKV + 3]  # row 1, entry 5, KV head 3
    ok = torch.equal(entry.cpu(), host[store.host_slot[jobs[1, 3, 5]].item(), 3])
    best = next(g for g in grids if g["programs"] == gv.PROGRAMS_PER_SM * sms)  # the default grid
    return {"chunks_moved": jobs.numel(), "bytes": moved, "pinned_h2d_copy_GBps": moved / t_copy / 1e9,
            "rebuild_ms": t_rebuild * 1e3, "gather_correct": ok, **best, "by_grid": grids}


def on_two_streams(side_fn, main_fn):
    """A callable running side_fn on a side stream beside main_fn, as the decoder runs the value
    gather beside the key rebuild (one after the other on a CPU)."""
    side = torch.cuda.Stream() if CUDA else None

    def both():
        if side is None:
            side_fn()
            main_fn()
            return
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            side_fn()
        main_fn()
        torch.cuda.current_stream().wait_stream(side)

    return both


# ---- 3: one decode layer -----------------------------------------------------------------------------
def full_attention_fn(batch: int, context: int, kv_pool: PagedKVPool, q: torch.Tensor):
    """Full attention over `context` cached tokens per request (FlashInfer if present, else the Triton
    kernel; on a CPU its torch reference)."""
    pages_per_req = context // kv_pool.page_size
    page_ids = torch.arange(1, 1 + batch * pages_per_req, dtype=torch.int32, device=DEV)
    try:
        import flashinfer
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device=DEV), "NHD")
        indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per_req  # host: no sync in plan
        last = torch.full((batch,), kv_pool.page_size, dtype=torch.int32)
        wrapper.plan(indptr, page_ids, last, HQ, HKV, D, kv_pool.page_size, pos_encoding_mode="NONE",
                     q_data_type=DT, kv_data_type=DT, sm_scale=D ** -0.5)
        shape = (-1, kv_pool.page_size, HKV, D)
        kv = (kv_pool.k_buffers[0].view(shape), kv_pool.v_buffers[0].view(shape))
        return "flashinfer", lambda: wrapper.run(q, kv)
    except ImportError:
        slots = (page_ids.long()[:, None] * kv_pool.page_size + torch.arange(kv_pool.page_size, device=DEV)).flatten().int()
        q_indptr = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
        kv_indptr = q_indptr * context
        args = (q, kv_pool.k_buffers[0], kv_pool.v_buffers[0], q_indptr, kv_indptr, slots, D ** -0.5)
        if not CUDA:  # --smoke: the torch reference (under the interpreter the kernel takes seconds a call)
            return "torch", lambda: ragged_paged_attention_reference(*args)
        return "triton", lambda: ragged_paged_attention(*args, max_q_len=1)


def hbm_copy_GBps() -> float:
    """The device's copy bandwidth (bytes read + written per second) on a 1 GiB tensor: the limit
    the decode layer's bytes are held against, measured in the same run."""
    src = torch.empty(1 << 29 if CUDA else 1 << 22, dtype=torch.int16, device=DEV)
    dst = torch.empty_like(src)
    return 2 * src.numel() * src.element_size() / timeit(lambda: dst.copy_(src)) / 1e9


def sparse_row_bytes(context: int, chunks: float, outliers: int, window: int, hit_rate: float, rank: int,
                     values_on_gpu: bool, storage: torch.dtype) -> dict:
    """The least bytes one compressed row's decode layer moves (DESIGN.md §2, decode steps 1-5), by
    kernel: the landmarks read (stored as `storage`, int8 with a float32 scale per chunk and KV
    head); per missed chunk its low-rank rows read and its keys written, its values read (stored as
    `storage`, from HBM or over PCIe) and written; then the attention's read of every attended key
    and value. Against a dense row's read of all its keys and values."""
    elt, stored, n = element_size(DT), element_size(storage), context // CHUNK
    scale = 4 if storage == torch.int8 else 0
    misses = (1 - hit_rate) * chunks * HKV
    block = CHUNK * D * elt  # one chunk of one KV head, keys or values
    values_read = misses * (CHUNK * D * stored + scale)
    parts = {"landmarks": n * HKV * (D * stored + scale),
             "rebuild": misses * (CHUNK * rank * elt + block),
             "gather": misses * block + (values_read if values_on_gpu else 0),
             "attention": 2 * (chunks + outliers) * HKV * block + 2 * window * HKV * D * elt}
    return {"hbm_bytes": parts, "pcie_bytes": 0 if values_on_gpu else values_read,
            "dense_bytes": 2 * context * HKV * D * elt}


def pinned_h2d_GBps() -> float:
    """Pinned host-to-device copy bandwidth on 256 MiB (the PCIe limit of host-resident values)."""
    if not CUDA:
        return 1.0
    src = torch.empty(1 << 27, dtype=torch.int16).pin_memory()
    dst = torch.empty(src.shape, dtype=src.dtype, device=DEV)
    return src.numel() * src.element_size() / timeit(lambda: dst.copy_(src, non_blocking=True)) / 1e9


def decode_layers(contexts: list[int], batches: list[int], homes: list[str], drifts: list[float]) -> dict:
    """decode_layer at every context, value home and query drift, with the bandwidths its floors
    are held to."""
    hbm, pcie = hbm_copy_GBps(), pinned_h2d_GBps()
    rows = [r for c in contexts for home in homes for drift in drifts
            for r in decode_layer(c, batches, 8, 72, home == "gpu", hbm, pcie, drift)]
    return {"hbm_copy_GBps": hbm, "pinned_h2d_GBps": pcie, "rows": rows}


def decode_layer(context: int, batches: list[int], steps: int, window: int, values_on_gpu: bool,
                 hbm_GBps: float, pcie_GBps: float, drift_by: float = 0.35) -> list[dict]:
    """One decode layer, ShadowKV against full attention, per batch size, values and landmarks
    stored as the server stores them by default (int8 on a GPU); with the device time of the
    sparse step's kernels (profiled eagerly) and its floor: its least bytes (sparse_row_bytes, at
    the measured chunk-cache hit rate and mean chunks selected) over the measured HBM copy
    bandwidth, or PCIe's when the host's values take longer. drift_by: how far each step's query
    moves from the last (0.35: about the paper's 60% chunk-cache hits; large: independent queries,
    as a model with random weights makes)."""
    max_b = max(batches)
    cfg = ShadowKVConfig(rank=RANK, outliers=48, budget=min(1.0, 256 / (context // CHUNK)), min_budget_chunks=1,
                         max_requests=max_b)
    n = context // CHUNK
    gen = torch.Generator(device=DEV).manual_seed(0)
    rotary = RotaryEmbedding(D, 500000.0, context + window + steps + 8).to(DEV)
    storage = torch.int8 if CUDA else DT
    store, segs = random_segments(max_b, context, cfg, rotary, gen, max_b * cfg.budget_chunks(n), values_on_gpu,
                                  storage)
    decoder = SparseDecoder(store, cfg, rotary, max_b, n, CUDA)  # its rows' pages: budget_chunks(n) each
    # dense pool: the full KV of every request (the full-attention baseline) + each one's window
    kv_pool = PagedKVPool(max_b * (context + window) // CHUNK + 2, CHUNK, 1, HKV, D, DT, DEV)
    for buf in (kv_pool.k_buffers[0], kv_pool.v_buffers[0]):
        for part in buf.split(1 << 20):
            part.normal_(generator=gen)
    table = ReqToTokenPool(max_b, context + window, DEV)
    win_base = 1 + max_b * context // CHUNK
    for b in range(max_b):
        table.table[b, context:] = (win_base * CHUNK + b * window + torch.arange(window, device=DEV)).int()
    rows = []
    for batch in batches:
        reqs = [SparseRequest(b, decoder.alloc_row(), segment_layout(segs[b], CHUNK), context + window)
                for b in range(batch)]
        plan = decoder.plan_step(table, reqs)
        q = torch.randn(batch, HQ, D, dtype=DT, device=DEV, generator=gen)
        drift = [q]
        for _ in range(steps):  # consecutive decode queries are correlated, as in real text
            drift.append(F.normalize(drift[-1].float() + drift_by * torch.randn_like(q, dtype=torch.float32), dim=-1)
                         .mul(D ** 0.5).to(DT))
        decoder.hits.zero_()
        for qi in drift:
            decoder.attend(qi, 0, plan, kv_pool)
        hits, lookups = decoder.hits[:batch].sum(0).tolist()
        it = iter(range(10 ** 9))
        q_in = drift[0].clone()  # a graph reads its query from one buffer: each timed step copies the next in

        def eager_step():
            q_in.copy_(drift[next(it) % len(drift)])
            decoder.attend(q_in, 0, plan, kv_pool)

        layer_step = replayed(lambda: decoder.attend(q_in, 0, plan, kv_pool))

        def shadow_step():
            q_in.copy_(drift[next(it) % len(drift)])
            layer_step()

        t_shadow = timeit(shadow_step)
        kernels = kernel_times(eager_step, top=12)
        name, full_fn = full_attention_fn(batch, context, kv_pool, q)
        t_full = timeit(full_fn)
        hit_rate = hits / max(1, lookups)
        chunks = decoder.budget_stats()["mean_chunks"]
        need = sparse_row_bytes(context, chunks, cfg.num_outliers(n), window, hit_rate, RANK, values_on_gpu, storage)
        floor_s = batch * max(sum(need["hbm_bytes"].values()) / (hbm_GBps * 1e9), need["pcie_bytes"] / (pcie_GBps * 1e9))
        dense_floor_s = batch * need["dense_bytes"] / (hbm_GBps * 1e9)
        rows.append({"context": context, "batch": batch, "values": "gpu" if values_on_gpu else "host",
                     "storage": str(storage).removeprefix("torch."), "query_drift": drift_by,
                     "shadowkv_ms": t_shadow * 1e3, "full_ms": t_full * 1e3, "full_backend": name,
                     "speedup": t_full / t_shadow, "chunk_cache_hit_rate": hit_rate, "mean_chunks": chunks,
                     "shadowkv_floor_ms": floor_s * 1e3, "shadowkv_vs_floor": t_shadow / floor_s,
                     "full_floor_ms": dense_floor_s * 1e3, "full_vs_floor": t_full / dense_floor_s,
                     "row_bytes": need, "kernels": kernels})
        for r in reqs:
            decoder.free_row(r.scratch_row)
    return rows


def key_split_cost(shapes: list[tuple[int, int]]) -> list[dict]:
    """The sparse attention kernel alone over 48 outlier and 256 selected chunks per KV head (the
    defaults' cap), for (requests, queries each) shapes: decode batches (1 query) and suffix tiles
    (64 queries), its keys split among programs as the kernel picks by default against one program each."""
    from sglang_shadowkv.kernels.sparse_decode_attention import default_key_splits, sparse_decode_attention

    gen = torch.Generator(device=DEV).manual_seed(3)
    entries, outliers, window = 256, 48, 64
    rows = []
    for requests, queries in shapes:
        pages = requests * (entries + outliers) + 1
        blocks_k, blocks_v = (torch.randn(pages * HKV, CHUNK, D, dtype=DT, device=DEV, generator=gen) for _ in range(2))
        page_ids = torch.randperm(pages - 1, device=DEV, generator=gen) + 1
        outlier_blocks = (page_ids[:requests * outliers].view(requests, 1, outliers) * HKV
                          + torch.arange(HKV, device=DEV)[:, None]).int()
        scratch = page_ids[requests * outliers:].view(requests, entries).int().contiguous()
        ent = torch.arange(entries, device=DEV, dtype=torch.int32).expand(requests, HKV, entries).contiguous()
        kv = torch.randn(requests * window, HKV, D, dtype=DT, device=DEV, generator=gen)
        indptr = (torch.arange(requests + 1, device=DEV) * window).int()
        q = torch.randn(requests * queries, HQ, D, dtype=torch.float32 if queries > 1 else DT, device=DEV,
                        generator=gen)
        args = (q, blocks_k, blocks_v, outlier_blocks, scratch, torch.arange(requests, device=DEV).int(), ent,
                kv, kv, indptr if queries == 1 else torch.zeros_like(indptr),
                torch.arange(requests * window, device=DEV).int(), D ** -0.5)
        lse = torch.empty(requests * queries, HQ, device=DEV)
        splits = default_key_splits(requests, HKV, queries, outliers, entries, CHUNK, DEV, HQ // HKV)
        one = timeit(replayed(lambda: sparse_decode_attention(*args, lse=lse, queries_per_request=queries, splits=1)))
        auto = timeit(replayed(lambda: sparse_decode_attention(*args, lse=lse, queries_per_request=queries)))
        rows.append({"requests": requests, "queries": queries, "splits": splits, "one_split_us": one * 1e6,
                     "split_us": auto * 1e6, "speedup": one / auto})
    return rows


def replayed(fn):
    """fn as a CUDA graph's replay on the GPU (device time alone, as the server's steps run it:
    eagerly, the host's launches would set the pace), else fn."""
    if not CUDA:
        return fn
    fn()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def print_key_splits(rows: list[dict]) -> None:
    print(f"\n{'requests':>8} {'queries':>7} {'splits':>6} {'1 split us':>10} {'split us':>9} {'speedup':>7}")
    for r in rows:
        print(f"{r['requests']:8d} {r['queries']:7d} {r['splits']:6d} {r['one_split_us']:10.1f} "
              f"{r['split_us']:9.1f} {r['speedup']:7.2f}")


# ---- 5: prefill compression cost ---------------------------------------------------------------------
class _CausalSdpa:
    """One request's causal prefill attention for the dense-layer baseline (GQA via repeat)."""

    def forward(self, q, k, v, layer, batch):
        rep = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(rep, 1).transpose(0, 1)[None] for t in (k, v))  # 4-D: flash path
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k, v, is_causal=True)[0].transpose(0, 1)


def dense_layer_seconds(context: int) -> float:
    from sglang_shadowkv.models.config import ModelConfig
    from sglang_shadowkv.models.llama import DecoderLayer

    cfg = ModelConfig(architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_layers=1, num_heads=HQ, num_kv_heads=HKV, head_dim=D, rope_theta=500000.0,
                      context_length=context)
    layer = DecoderLayer(cfg, 0).to(DEV, DT)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02)
    rotary = RotaryEmbedding(D, 500000.0, context).to(DEV)
    x = torch.randn(context, 4096, dtype=DT, device=DEV)
    pos = torch.arange(context, device=DEV)
    with torch.inference_mode():
        return timeit(lambda: layer(x, pos, rotary, _CausalSdpa(), None), reps=5, warmup=1)


COMPRESSION_METHODS = {"eigh": {}, "subspace": {}, "subspace_energy": {"lowrank_method": "subspace", "rank": None,
                                                                      "rank_cap": RANK, "rank_energy": 0.99}, "svd": {}}


def compression_parts(k: torch.Tensor, rotary: RotaryEmbedding) -> dict:
    """Milliseconds of the pieces of one layer's compression, Triton kernels beside their references."""
    from sglang_shadowkv.kernels.chunk_stats import chunk_stats, chunk_stats_reference
    from sglang_shadowkv.kernels.rotary import rotate, rotate_reference
    from sglang_shadowkv.shadowkv.compress import spectrum_of_grams, tf32_matmuls

    pos = torch.arange(k.shape[0], device=DEV)
    rot_args = (k, rotary.cos_cache, rotary.sin_cache, pos, True, torch.float32)
    x = rotate(*rot_args).reshape(k.shape[0], -1)
    gram = x.T @ x
    grams = gram.expand(LAYERS, -1, -1).contiguous()
    ms = lambda fn: timeit(fn, reps=5, warmup=1) * 1e3  # noqa: E731

    def gram_tf32():
        with tf32_matmuls():
            return x.T @ x

    return {"inverse_rope_triton_ms": ms(lambda: rotate(*rot_args)),
            "inverse_rope_reference_ms": ms(lambda: rotate_reference(*rot_args)),
            "gram_tf32_ms": ms(gram_tf32),
            "subspace_one_layer_ms": ms(lambda: spectrum_of_grams(gram[None], RANK, "subspace")),
            f"subspace_{LAYERS}_layers_batched_ms": ms(lambda: spectrum_of_grams(grams, RANK, "subspace")),
            "chunk_stats_triton_ms": ms(lambda: chunk_stats(k, CHUNK)),
            "chunk_stats_reference_ms": ms(lambda: chunk_stats_reference(k, CHUNK))}


def compression_cost(context: int) -> dict:
    """One layer's compression per low-rank method: time on the compute stream (the host value copy
    runs on a side stream, overlapping the next layer) and time until that copy is done too, the
    pieces' times, and each method's key reconstruction error against the SVD's (the optimum)."""
    cfg = ShadowKVConfig(rank=RANK, outliers=48)
    store, (seg,) = segment_store(1, context, cfg.num_outliers(context // CHUNK), 0)
    rotary = RotaryEmbedding(D, 500000.0, context).to(DEV)
    gen = torch.Generator(device=DEV).manual_seed(1)
    spectrum = torch.arange(1, HKV * D + 1, device=DEV) ** -0.75  # keys' singular values decay slowly
    k_pre = (torch.randn(context, HKV * D, device=DEV, generator=gen) * spectrum
             @ torch.linalg.qr(torch.randn(HKV * D, HKV * D, device=DEV, generator=gen)).Q).view(context, HKV, D)
    k = rotary.apply(k_pre, torch.arange(context, device=DEV)).to(DT)
    v = torch.randn(context, HKV, D, dtype=DT, device=DEV, generator=gen)
    t_dense = dense_layer_seconds(context)
    x = k_pre.reshape(context, -1)
    rel_error = lambda b: ((x - x @ b.T @ b).norm() / x.norm()).item()  # noqa: E731
    svd_rows = low_rank_basis(x, RANK, method="svd")
    row = {"context": context, "dense_layer_ms": t_dense * 1e3, "svd_rel_error": rel_error(svd_rows),
           **compression_parts(k, rotary)}
    for name, overrides in COMPRESSION_METHODS.items():
        mcfg = ShadowKVConfig(**{"rank": RANK, "lowrank_method": name, **overrides})

        def compress(wait: bool, mcfg=mcfg):
            compress_layer(store, seg, 0, k, v, rotary, mcfg)
            if wait:
                store.wait_host_writes()

        with torch.inference_mode():
            row[f"compress_{name}_ms"] = timeit(lambda: compress(False), reps=5, warmup=1) * 1e3
            row[f"compress_{name}_with_host_copy_ms"] = timeit(lambda: compress(True), reps=5, warmup=1) * 1e3
        row[f"{name}_share_of_dense"] = row[f"compress_{name}_ms"] / row["dense_layer_ms"]
        b = low_rank_basis(x, RANK, mcfg.energy, mcfg.lowrank_method)
        row[f"{name}_rank"] = b.shape[0]
        row[f"{name}_error_vs_svd"] = rel_error(b) / rel_error(svd_rows[:b.shape[0]])
    row.update(segment_compression_cost(context, k, v, rotary, t_dense))
    return row


def segment_compression_cost(context: int, k: torch.Tensor, v: torch.Tensor, rotary: RotaryEmbedding,
                             t_dense: float) -> dict:
    """A whole segment's compression as the engine runs it at default settings (every layer added
    as its attention ran, the bases of all layers solved together at the end), the same keys in
    every layer, against the dense prefill of that many layers; values and landmarks int8 on a GPU
    (the server's default), with the device time of its kernels (`segment_profile`)."""
    cfg = ShadowKVConfig()
    storage = torch.int8 if CUDA else DT
    store, (seg,) = segment_store(1, context, cfg.num_outliers(context // CHUNK), 0, layers=LAYERS, storage=storage)

    def compress():
        job = SegmentCompression(store, seg, rotary, cfg)
        for layer in range(LAYERS):
            job.add_layer(layer, k, v)
        job.finish(lambda _: (k, v))

    with torch.inference_mode():
        seconds = timeit(compress, reps=3, warmup=1)
        host = []  # the host's time to launch it all, the device idle before (its launches' own cost)
        for _ in range(3):
            if CUDA:
                torch.cuda.synchronize()
            t = time.perf_counter()
            compress()
            host.append(time.perf_counter() - t)
        profile = kernel_times(compress)
    return {"segment_layers": LAYERS, "compress_segment_ms": seconds * 1e3,
            "compress_segment_host_ms": statistics.median(host) * 1e3,
            "segment_share_of_dense": seconds / (LAYERS * t_dense), "segment_ranks": seg.settle_ranks(),
            "segment_profile": profile}


def kernel_times(fn, top: int = 30) -> dict:
    """Device time of fn()'s kernels and copies (torch.profiler), the `top` longest by name, and
    how many launches it made: where a many-kernel step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profile(activities=activities) as prof:
        fn()
        if CUDA:
            torch.cuda.synchronize()
    key = "self_device_time_total" if CUDA else "self_cpu_time_total"
    kernels = [e for e in prof.key_averages() if getattr(e, key) > 0 and (not CUDA or e.device_type.name == "CUDA")]
    kernels.sort(key=lambda e: -getattr(e, key))
    return {"device_ms": sum(getattr(e, key) for e in kernels) / 1e3, "launches": sum(e.count for e in kernels),
            "top": [{"op": e.key[:90], "ms": getattr(e, key) / 1e3, "calls": e.count} for e in kernels[:top]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: check the script on any device")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"), "bench_kernels.json"))
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="which tables to run")
    ap.add_argument("--contexts", nargs="+", type=int, help="contexts of the compression and decode-layer tables "
                    "(default 32768 131072; --smoke 512)")
    ap.add_argument("--batches", nargs="+", type=int, help="decode-layer batch sizes (default 1 4 8 16 24 32 48; "
                    "--smoke 1 2)")
    ap.add_argument("--values", nargs="+", choices=("gpu", "host"), default=["gpu", "host"],
                    help="where the decode layer's compressed values are read: the GPU copy the server keeps "
                    "while memory allows, pinned host memory, or both (default)")
    ap.add_argument("--query-drift", nargs="+", type=float, default=[0.35],
                    help="how far each decode query moves from the last, per run of the decode layer (default "
                    "0.35: about the paper's 60%% chunk-cache hits; 10: independent queries, as random weights give)")
    args = ap.parse_args()
    if args.smoke:
        contexts, batches, slots, entries = [512], [1, 2], 256, 16
    else:
        contexts, batches, slots, entries = [32768, 131072], [1, 4, 8, 16, 24, 32, 48], 1 << 17, 256
    contexts, batches = args.contexts or contexts, args.batches or batches
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__}
    runs = {"bandwidth": lambda: bandwidth_and_overlap(slots, 48 if not args.smoke else 2, entries),
            "compression": lambda: [compression_cost(c) for c in contexts],
            "decode_layer": lambda: decode_layers(contexts, batches, args.values, args.query_drift),
            "key_splits": lambda: key_split_cost([(1, 1), (2, 1)] if args.smoke else
                                                 [(1, 1), (4, 1), (8, 1), (16, 1), (48, 1), (1, 64), (4, 64), (16, 64)])}
    for part in args.parts:
        result[part] = runs[part]()
        with open(args.out, "w") as f:  # partial results survive a later failure
            json.dump(result, f, indent=1)
    print(f"\ndevice: {result['device']}")
    if "bandwidth" in result:
        print_bandwidth(result["bandwidth"])
    if "compression" in result:
        print_compression(result["compression"])
    if "decode_layer" in result:
        print_decode_layer(result["decode_layer"])
    if "key_splits" in result:
        print_key_splits(result["key_splits"])


def print_bandwidth(bw: dict) -> None:
    for g in bw["by_grid"]:
        print(f"gather grid {g['programs']:5d}: {g['gather_GBps']:5.1f} GB/s ({g['gather_vs_copy']:.0%} of copy), "
              f"with rebuild {g['both_two_streams_ms']:.3f} ms, rebuild hidden {g['rebuild_hidden_fraction']:.0%}")
    print(f"value gather {bw['gather_GBps']:.1f} GB/s vs pinned H2D copy {bw['pinned_h2d_copy_GBps']:.1f} GB/s "
          f"({bw['gather_vs_copy']:.0%}); rebuild {bw['rebuild_ms']:.3f} ms, gather {bw['gather_ms']:.3f} ms, "
          f"both {bw['both_two_streams_ms']:.3f} ms: {bw['rebuild_hidden_fraction']:.0%} of rebuild hidden")


def print_compression(rows: list[dict]) -> None:
    print(f"\n{'context':>8} {'method':>16} {'rank':>4} {'dense ms':>9} {'compress ms':>11} {'share':>7} "
          f"{'+host copy ms':>13} {'err/svd':>7}")
    for r in rows:
        for m in COMPRESSION_METHODS:
            print(f"{r['context']:8d} {m:>16} {r[f'{m}_rank']:4d} {r['dense_layer_ms']:9.2f} "
                  f"{r[f'compress_{m}_ms']:11.2f} {r[f'{m}_share_of_dense']:7.2%} "
                  f"{r[f'compress_{m}_with_host_copy_ms']:13.2f} {r[f'{m}_error_vs_svd']:7.3f}")
        print("  parts (ms): " + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in r.items() if k.endswith("_ms")
                                          and not k.startswith(("compress_", "dense_"))))
        print(f"  a {r['segment_layers']}-layer segment at defaults: {r['compress_segment_ms']:.1f} ms "
              f"({r['compress_segment_host_ms']:.1f} ms launching it), "
              f"{r['segment_share_of_dense']:.1%} of its dense prefill (ranks {min(r['segment_ranks'])}-"
              f"{max(r['segment_ranks'])})")
        prof = r["segment_profile"]
        print(f"  its kernels: {prof['device_ms']:.1f} ms of device time in {prof['launches']} launches; longest:")
        for op in prof["top"][:12]:
            print(f"    {op['ms']:7.2f} ms {op['calls']:5d}x  {op['op']}")


def print_decode_layer(result: dict) -> None:
    print(f"\nHBM copy {result['hbm_copy_GBps']:.0f} GB/s, pinned H2D {result['pinned_h2d_GBps']:.1f} GB/s")
    print(f"{'context':>8} {'values':>6} {'drift':>5} {'batch':>5} {'shadowkv ms':>11} {'floor':>6} {'full ms':>8} {'floor':>6} "
          f"{'sparse/full':>11} {'hit':>5}  full backend")
    for r in result["rows"]:
        print(f"{r['context']:8d} {r['values']:>6} {r['query_drift']:5.2f} {r['batch']:5d} {r['shadowkv_ms']:11.3f} "
              f"{r['shadowkv_vs_floor']:5.1f}x {r['full_ms']:8.3f} {r['full_vs_floor']:5.1f}x "
              f"{1 / r['speedup']:11.2f} {r['chunk_cache_hit_rate']:5.2f}  {r['full_backend']}")
    for r in result["rows"]:
        top = ", ".join(f"{k['op'][:28]} {k['ms']:.3f}" for k in r["kernels"]["top"][:8])
        print(f"  {r['context']} {r['values']} drift {r['query_drift']} x{r['batch']} kernels (eager, ms): {top}")


if __name__ == "__main__":
    main()
