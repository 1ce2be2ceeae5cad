"""Launch settings of the three kernels of a compressed decode step, timed against each other on
the GPU at the server's shapes, to choose their defaults.

One layer of Llama-3.1-8B-shaped state (8 KV heads, 32 query heads, head dim 128, bf16; chunk 8,
rank 160, 48 outliers, int8 values and landmarks as the server keeps them on a GPU), `--requests`
decoding requests over 16K-token documents (one document each, compressed by the engine's
compress_layer from random keys and values, their values also in lent GPU pages as the server
does when memory allows), 256 selected chunks per KV head and every one a chunk-cache miss (the
selection of random weights: hit rate 0.02, the worst case the serving benchmark meets). Timed as
CUDA-graph replays (device time, as the server runs its steps):
  1. value gather (kernels/gather_values.py), from the GPU copy and from pinned host memory:
     chunks a program moves per step x programs per SM;
  2. key rebuild (kernels/rebuild_keys.py): rank columns per step x warps x pipeline stages x rows
     per program;
  3. sparse attention (kernels/sparse_decode_attention.py): keys per step x warps x stages x splits;
  4. rebuild and gather together on two streams, as the decoder runs them, by the gather's grid.
Every variant's output is checked against the default's. Prints the fastest few per kernel and
writes JSON to --out (default tune_decode_kernels.json in $OUT, else in the current folder).
The defaults it chose (2026-11-26, H100) are in the kernels' own comments and docs/design.md.

    python maintainers/experiments/tune_decode_kernels.py            # on the GPU
    python maintainers/experiments/tune_decode_kernels.py --smoke    # tiny sizes, few variants, any device
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository's package and bench_kernels' helpers

if not torch.cuda.is_available():  # --smoke on a CPU: the kernels run under Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench_kernels import CHUNK, CUDA, D, DEV, DT, HKV, HQ, RANK, on_two_streams, replayed, timeit  # noqa: E402

from sglang_shadowkv.kernels import gather_values as gv  # noqa: E402
from sglang_shadowkv.kernels import rebuild_keys as rk  # noqa: E402
from sglang_shadowkv.kernels import sparse_decode_attention as sd  # noqa: E402
from sglang_shadowkv.layers.rotary import RotaryEmbedding  # noqa: E402
from sglang_shadowkv.mem_cache.compressed_layout import segment_pages, slot_layout  # noqa: E402
from sglang_shadowkv.mem_cache.compressed_pool import ShadowKVPool  # noqa: E402
from sglang_shadowkv.mem_cache.kv_pool import PagedKVPool  # noqa: E402
from sglang_shadowkv.shadowkv.compress import compress_layer  # noqa: E402
from sglang_shadowkv.shadowkv.config import ShadowKVConfig  # noqa: E402

WINDOW = 64


@contextlib.contextmanager
def knobs(module, **values):
    """Set a kernel module's launch constants for the block, restoring them after."""
    old = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in old.items():
            setattr(module, name, value)


class DecodeState:
    """A compressed pool holding one document per request, every request's jobs for one step, and
    the sparse attention's other inputs."""

    def __init__(self, requests: int, tokens: int, entries: int, gen: torch.Generator):
        cfg = ShadowKVConfig(rank=RANK)
        n = tokens // CHUNK
        self.outliers = cfg.num_outliers(n)
        value_dtype = torch.int8 if CUDA else None
        layout = slot_layout(CHUNK, HKV, D, RANK, DT, value_dtype or DT, value_dtype or DT)
        per_doc = segment_pages(layout, n, self.outliers, RANK, CHUNK) + n  # + lent value pages (n: ample)
        kv = PagedKVPool(requests * (per_doc + entries) + 4, CHUNK, 1, HKV, D, DT, DEV)
        store = ShadowKVPool(kv, RANK, requests * n, requests, value_dtype=value_dtype, landmark_dtype=value_dtype)
        rotary = RotaryEmbedding(D, 500000.0, tokens + WINDOW).to(DEV)
        segs = []
        for _ in range(requests):
            seg = store.alloc_segment(0, tokens, self.outliers)
            k, v = (torch.randn(tokens, HKV, D, dtype=DT, device=DEV, generator=gen) for _ in range(2))
            compress_layer(store, seg, 0, k, v, rotary, cfg)
            segs.append(seg)
        store.wait_host_writes()
        self.store, self.rotary, self.segs = store, rotary, segs
        cpu = torch.Generator().manual_seed(1)
        self.jobs = torch.stack([seg.chunk_slots[torch.randperm(n, generator=cpu)[:entries].to(DEV)]
                                 for seg in segs for _ in range(HKV)]).view(requests, HKV, entries)
        self.rows = torch.arange(requests, dtype=torch.int32, device=DEV)
        self.scratch_pages = torch.tensor(kv.alloc(requests * entries), dtype=torch.int32,
                                          device=DEV).view(requests, entries)
        self.entries = torch.arange(entries, dtype=torch.int32, device=DEV).expand(requests, HKV, entries).contiguous()
        self.outlier_blocks = torch.stack([seg.outlier_blocks for seg in segs])
        self.q = torch.randn(requests, HQ, D, dtype=DT, device=DEV, generator=gen)
        self.window = torch.randn(requests * WINDOW, HKV, D, dtype=DT, device=DEV, generator=gen)
        self.window_indptr = (torch.arange(requests + 1, device=DEV) * WINDOW).int()
        self.window_indices = torch.arange(requests * WINDOW, device=DEV).int()

    def load_gpu_values(self) -> None:
        self.store.kv.reclaim = lambda pages: None  # lending needs a reclaim hook; nothing asks for these back
        for seg in self.segs:
            if not self.store.load_values(seg):
                raise RuntimeError("no pages to lend for the GPU values")
        if CUDA:
            torch.cuda.synchronize()

    def gather(self, resident: bool, **launch):
        s = self.store
        return lambda: gv.gather_values(s.host_v[0], s.host_slot, self.jobs, s.blocks_v[0], self.scratch_pages,
                                        self.rows, None if s.value_scale is None else s.value_scale[0],
                                        s.resident(0) if resident else None, **launch)

    def rebuild(self):
        s = self.store
        return lambda: rk.rebuild_keys(s.a_lo[0], s.a_hi[0], *s.basis_memory(0), self.rotary.cos_cache,
                                       self.rotary.sin_cache, s.chunk_pos, s.chunk_basis, self.jobs, s.blocks_k[0],
                                       self.scratch_pages, self.rows, s.basis_rank[0])

    def attend(self, splits: int):
        s = self.store
        return lambda: sd.sparse_decode_attention(
            self.q, s.blocks_k[0], s.blocks_v[0], self.outlier_blocks, self.scratch_pages, self.rows, self.entries,
            self.window, self.window, self.window_indptr, self.window_indices, D ** -0.5, splits=splits)

    def scratch(self, blocks: torch.Tensor) -> torch.Tensor:
        """The scratch blocks of every entry (what the gather and the rebuild write)."""
        ids = (self.scratch_pages.long()[:, None, :] * HKV + torch.arange(HKV, device=DEV)[None, :, None])
        return blocks[ids.flatten()].clone()


def measure(fn, check) -> dict:
    """Median µs of fn's graph replay and whether its output passes `check`."""
    graph = replayed(fn)
    seconds = timeit(graph, reps=30 if CUDA else 1, warmup=3 if CUDA else 0)
    graph()
    return {"us": seconds * 1e6, "correct": bool(check())}


def sweep(name: str, variants: list[dict], run) -> list[dict]:
    """run(variant) -> measure's dict; rows sorted fastest first, the default (first) marked."""
    rows = []
    for i, variant in enumerate(variants):
        try:
            measured = run(variant)
        except Exception as e:  # a setting the compiler rejects (shared memory, layouts): noted, skipped
            if i == 0:
                raise
            measured = {"us": None, "correct": False, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        rows.append({"kernel": name, **variant, **measured, "default": i == 0})
    base = rows[0]["us"]
    for row in rows:
        row["vs_default"] = None if row["us"] is None else base / row["us"]
    return sorted(rows, key=lambda r: float("inf") if r["us"] is None else r["us"])


def tune(state: DecodeState, smoke: bool) -> dict:
    s = state.store
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count if CUDA else 2
    out = {}
    # 1: value gather, from the GPU copy and from pinned host memory
    state.load_gpu_values()
    gather_want = {}
    for resident in (True, False):
        s.blocks_v[0].zero_()
        state.gather(resident, programs=gv.PROGRAMS_PER_SM * sms)()
        gather_want[resident] = state.scratch(s.blocks_v[0])
    grid = [(gv.JOBS_PER_STEP, gv.PROGRAMS_PER_SM)] + [
        v for v in itertools.product((1, 2, 4, 8, 16), (1, 2, 4, 8)) if v != (gv.JOBS_PER_STEP, gv.PROGRAMS_PER_SM)]
    if smoke:
        grid = grid[:2]
    for resident in (True, False):
        def run(v, resident=resident):
            s.blocks_v[0].zero_()
            fn = state.gather(resident, programs=v["programs_per_sm"] * sms, jobs_per_step=v["jobs_per_step"])
            return measure(fn, lambda: torch.equal(state.scratch(s.blocks_v[0]), gather_want[resident]))

        out["gather_gpu_values" if resident else "gather_host_values"] = sweep(
            "gather", [{"jobs_per_step": j, "programs_per_sm": p} for j, p in grid], run)
    # 2: key rebuild
    s.blocks_k[0].zero_()
    state.rebuild()()
    keys_want = state.scratch(s.blocks_k[0]).float()
    default = (rk.RANK_BLOCK, rk.WARPS, rk.STAGES, rk.ROWS_PER_PROGRAM)
    grid = [default] + [v for v in itertools.product((32, 64), (4, 8), (None, 1, 2, 4), (64, 128)) if v != default]
    if smoke:
        grid = grid[:2]

    def run_rebuild(v):
        s.blocks_k[0].zero_()
        with knobs(rk, RANK_BLOCK=v["rank_block"], WARPS=v["warps"], STAGES=v["stages"],
                   ROWS_PER_PROGRAM=v["rows_per_program"]):
            return measure(state.rebuild(), lambda: torch.allclose(state.scratch(s.blocks_k[0]).float(), keys_want,
                                                                   rtol=2e-2, atol=2e-2))

    out["rebuild"] = sweep("rebuild", [dict(zip(("rank_block", "warps", "stages", "rows_per_program"), v))
                                       for v in grid], run_rebuild)
    # 3: sparse attention of a decode batch (over the keys and values the defaults put in the scratch)
    attn_want = state.attend(None)().float()
    launch = sd.DECODE_LAUNCH
    default = (launch.keys_per_block, launch.warps, launch.stages, None)
    grid = [default] + [v for v in itertools.product((32, 64, 128), (4, 8), (None, 1, 2, 4), (1, 2, 4)) if v != default]
    if smoke:
        grid = grid[:2]

    def run_attend(v):
        setting = sd.Launch(keys_per_block=v["keys_per_block"], warps=v["warps"], stages=v["stages"],
                            least_splits=launch.least_splits)
        with knobs(sd, DECODE_LAUNCH=setting):
            result = {}
            fn = state.attend(v["splits"])
            return measure(lambda: result.__setitem__("o", fn()), lambda: torch.allclose(
                result["o"].float(), attn_want, rtol=2e-2, atol=2e-2))

    out["attention"] = sweep("attention", [dict(zip(("keys_per_block", "warps", "stages", "splits"), v))
                                           for v in grid], run_attend)
    # 4: rebuild + gather on two streams, as the decoder runs them, by the gather's grid
    out["fetch_two_streams"] = [two_streams(state, sms, resident, programs_per_sm)
                                for resident in (True, False) for programs_per_sm in (2, 4, 8)]
    return out


def two_streams(state: DecodeState, sms: int, resident: bool, programs_per_sm: int) -> dict:
    """The key rebuild on the compute stream while the gather runs on a side stream."""
    both = on_two_streams(state.gather(resident, programs=programs_per_sm * sms), state.rebuild())
    seconds = timeit(replayed(both), reps=30 if CUDA else 1, warmup=3 if CUDA else 0)
    return {"values": "gpu" if resident else "host", "gather_programs_per_sm": programs_per_sm,
            "us": seconds * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, two variants per kernel: checks the script")
    ap.add_argument("--requests", type=int, nargs="+", default=[16, 48], help="decoding requests (one table each)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "tune_decode_kernels.json"))
    args = ap.parse_args()
    tokens, entries, requests = (512, 8, [2]) if args.smoke else (16384, 256, args.requests)
    result = {"device": torch.cuda.get_device_name() if CUDA else "cpu", "tokens": tokens, "entries": entries,
              "runs": []}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for n in requests:
        state = DecodeState(n, tokens, entries, torch.Generator(device=DEV).manual_seed(n))
        result["runs"].append({"requests": n, **tune(state, args.smoke)})
        del state
        with open(args.out, "w") as f:  # partial results survive a later failure
            json.dump(result, f, indent=1)
    print(f"device: {result['device']}, {tokens} tokens a document, {entries} chunks per KV head, all misses")
    for run in result["runs"]:
        print(f"\n== {run['requests']} requests ==")
        for part in ("gather_gpu_values", "gather_host_values", "rebuild", "attention"):
            rows = run[part]
            default = next(r for r in rows if r["default"])
            print(f"{part}: default {default['us']:.1f} µs")
            for r in [r for r in rows if r["us"] is not None][:4]:
                knob = {k: v for k, v in r.items() if k not in ("kernel", "us", "correct", "default", "vs_default")}
                print(f"   {r['us']:8.1f} µs  {r['vs_default']:.2f}x  correct={r['correct']}  {knob}")
            failed = sum(r["us"] is None for r in rows)
            if failed:
                print(f"   ({failed} settings failed to compile or run: see the JSON)")
        for r in run["fetch_two_streams"]:
            print(f"rebuild + gather ({r['values']} values, {r['gather_programs_per_sm']} programs per SM) "
                  f"on two streams: {r['us']:.1f} µs")


if __name__ == "__main__":
    main()
