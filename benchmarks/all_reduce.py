"""What one all-reduce of a decode step costs under tensor parallelism, by implementation.

A decode step of a Llama-shaped model all-reduces its hidden states twice a layer (after o_proj
and after down_proj): 64 times a step for the 8B shape, 160 for the 70B. Each is small (rows x
hidden bf16: 16 KB for one row of the 70B shape), so its latency, not the link's bandwidth, sets
the cost. Per size this times, inside a CUDA graph of `--ops` back-to-back all-reduces (as the
decode graphs run them) and eagerly:
- NCCL (`torch.distributed.all_reduce`, what layers/linear.py calls);
- PyTorch symmetric memory, one-shot and two-shot (peers read each other's buffer over NVLink;
  no multicast), where this torch has it.
Each result is checked against the exact sum.

    python benchmarks/all_reduce.py --world-size 2 --out all_reduce.json     # (GPU, 2+ GPUs)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def graph_us(fn, ops: int, repeats: int) -> float:
    """Microseconds per call of fn, run `ops` times in one CUDA graph, the graph replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            fn()
    for _ in range(3):
        graph.replay()
    dist.barrier()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (repeats * ops)


def eager_us(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / repeats


def symmetric_memory():
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    return symm_mem if hasattr(torch.ops, "symm_mem") else None


def rank_main(rank: int, world: int, port: int, args, results) -> None:
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    group = dist.group.WORLD
    symm_mem = symmetric_memory()
    most = max(args.rows) * max(args.hidden)
    buffer = None
    if symm_mem is not None:
        try:
            buffer = symm_mem.empty(most, dtype=torch.bfloat16, device=device)
            symm_mem.rendezvous(buffer, group.group_name)
        except Exception as err:  # noqa: BLE001 - reported, the NCCL rows still run
            results[f"symm_mem_error_rank{rank}"] = repr(err)[:300]
            buffer = None
    rows_out = []
    for hidden in args.hidden:
        for rows in args.rows:
            n = rows * hidden
            x = torch.full((n,), float(rank + 1), dtype=torch.bfloat16, device=device)
            expected = world * (world + 1) / 2
            impls = {"nccl": lambda: dist.all_reduce(x, group=group)}
            if buffer is not None:
                part = buffer[:n]
                impls["symm_one_shot"] = lambda: part.copy_(
                    torch.ops.symm_mem.one_shot_all_reduce(part, "sum", group.group_name))
                impls["symm_two_shot"] = lambda: torch.ops.symm_mem.two_shot_all_reduce_(part, "sum", group.group_name)
            row = {"rows": rows, "hidden": hidden, "bytes": n * 2}
            for name, fn in impls.items():
                target = x if name == "nccl" else buffer[:n]
                try:
                    target.fill_(rank + 1)
                    fn()
                    torch.cuda.synchronize()
                    row[f"{name}_correct"] = bool((target.float() == expected).all())
                    row[f"{name}_graph_us"] = round(graph_us(fn, args.ops, args.repeats), 2)
                    row[f"{name}_eager_us"] = round(eager_us(fn, args.repeats * 4), 2)
                except Exception as err:  # noqa: BLE001 - one implementation failing is a result
                    row[f"{name}_error"] = repr(err)[:300]
            rows_out.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if rank == 0:
        results["sizes"] = rows_out
        results["device"] = torch.cuda.get_device_name(device)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64], help="decode rows per step")
    ap.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192], help="8B and 70B hidden sizes")
    ap.add_argument("--ops", type=int, default=64, help="all-reduces in one graph (a step's count)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"--world-size {args.world_size} needs as many GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(rank_main, args=(args.world_size, free_port(), args, results), nprocs=args.world_size)
        report = {"world_size": args.world_size, "ops_per_graph": args.ops,
                  "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")},
                  **dict(results)}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
