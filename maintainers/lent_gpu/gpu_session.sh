#!/usr/bin/env bash
# One device call: the ShadowKV kernel benchmark and the fidelity runs on the embedded model.
# Expects flashinfer under /tmp/site and the embedded GGUF at /tmp/smol.gguf (README.md here).
cd "$(dirname "$0")/../.." || exit 1  # the repository root
export PYTHONPATH=/tmp/site:. MAX_JOBS=16
mkdir -p "$OUT"
timeout 280 python3 benchmarks/bench_kernels.py > "$OUT/bench_kernels.log" 2>&1; echo "bench rc=$?"
for cfg in "96 96" "96 192" "160 192"; do
  set -- $cfg
  timeout 90 python3 benchmarks/fidelity.py --model-path /tmp/smol.gguf --attention-backend triton \
    --shadowkv-rank "$1" --shadowkv-min-budget-chunks "$2" --out "$OUT/fidelity_r$1_b$2.json" \
    > "$OUT/fidelity_r$1_b$2.log" 2>&1; echo "fidelity $cfg rc=$?"; tail -3 "$OUT/fidelity_r$1_b$2.log"
done
tail -22 "$OUT/bench_kernels.log"
