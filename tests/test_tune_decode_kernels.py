"""maintainers/experiments/tune_decode_kernels.py at its smoke sizes: every kernel's variants run,
agree with the default launch, and the report names the default of each table."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tune_decode_kernels_smoke(tmp_path):
    out = tmp_path / "tune.json"
    done = subprocess.run([sys.executable, "maintainers/experiments/tune_decode_kernels.py", "--smoke",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = json.loads(out.read_text())["runs"]
    for part in ("gather_gpu_values", "gather_host_values", "rebuild", "attention"):
        rows = run[part]
        assert len(rows) == 2 and sum(r["default"] for r in rows) == 1
        assert all(r["correct"] and r["us"] > 0 for r in rows), rows
    assert {(r["values"], r["gather_programs_per_sm"]) for r in run["fetch_two_streams"]} == {
        (v, p) for v in ("gpu", "host") for p in (2, 4, 8)}
    assert "rebuild: default" in done.stdout
