"""benchmarks/bench_kernels.py's decode-layer table at its smoke sizes on a CPU (torch references for
the kernels): both value homes run, each row has its floor, its kernels and the bytes the floor
counts, and misses cost bytes that hits do not."""

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_decode_layer_smoke(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "benchmarks/bench_kernels.py", "--smoke", "--parts", "decode_layer",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())["decode_layer"]
    assert result["hbm_copy_GBps"] > 0 and result["pinned_h2d_GBps"] > 0
    rows = result["rows"]
    assert {(r["values"], r["batch"]) for r in rows} == {(v, b) for v in ("gpu", "host") for b in (1, 2)}
    for r in rows:
        assert r["shadowkv_ms"] > 0 and r["shadowkv_floor_ms"] > 0 and r["full_floor_ms"] > 0
        assert r["kernels"]["launches"] > 0 and r["kernels"]["top"]
        assert (r["row_bytes"]["pcie_bytes"] > 0) == (r["values"] == "host")
    assert "sparse/full" in done.stdout


def test_row_bytes_count_what_a_miss_moves():
    from bench_kernels import DT, HKV, D, sparse_row_bytes

    elt = torch.empty(0, dtype=DT).element_size()  # the model's dtype: keys, low-rank rows, scratch
    hit = sparse_row_bytes(32768, 256, 48, 64, 1.0, 160, True, torch.int8)
    miss = sparse_row_bytes(32768, 256, 48, 64, 0.0, 160, True, torch.int8)
    assert hit["hbm_bytes"]["rebuild"] == hit["hbm_bytes"]["gather"] == 0 == hit["pcie_bytes"]
    assert miss["hbm_bytes"]["landmarks"] == hit["hbm_bytes"]["landmarks"] == 4096 * HKV * (D + 4)
    assert miss["hbm_bytes"]["rebuild"] == 256 * HKV * (8 * 160 + 8 * D) * elt
    on_host = sparse_row_bytes(32768, 256, 48, 64, 0.0, 160, False, torch.int8)
    assert on_host["pcie_bytes"] == 256 * HKV * (8 * D + 4)  # int8 values and their scale, over PCIe
    assert miss["dense_bytes"] == 2 * 32768 * HKV * D * elt
