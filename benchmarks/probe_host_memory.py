"""How much exact-size page-locked host memory this machine grants (the ShadowKV host pool's limit).

Registers 4 GiB blocks one by one until --max-gib or a failure; prints the running total after
each, so the last line printed is the answer even if the process is killed for memory.

    python benchmarks/probe_host_memory.py --max-gib 96
"""

from __future__ import annotations

import argparse

import torch

from sglang_shadowkv.mem_cache.host_memory import PinnedHostTensor

GiB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-gib", type=int, default=96)
    ap.add_argument("--block-gib", type=int, default=4)
    args = ap.parse_args()
    blocks = []
    try:
        while (len(blocks) + 1) * args.block_gib <= args.max_gib:
            blocks.append(PinnedHostTensor((args.block_gib * GiB,), torch.uint8))
            print(f"page-locked {len(blocks) * args.block_gib} GiB", flush=True)
    except MemoryError as exc:
        print(f"stopped: {exc}", flush=True)
    print(f"granted {len(blocks) * args.block_gib} GiB of page-locked host memory")


if __name__ == "__main__":
    main()
