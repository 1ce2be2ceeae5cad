#!/usr/bin/env bash
# Fidelity sweep on the device in float32 (torch attention backend; ShadowKV kernels in Triton).
# Expects the embedded GGUF at /tmp/smol.gguf. Each "rank min_budget_chunks" pair is one run.
export PYTHONPATH=/tmp/site:.
mkdir -p "$OUT"
for cfg in "192 1000" "30 32" "96 96" "96 192" "160 192"; do
  set -- $cfg
  name="fidelity_r$1_b$2_gpu_fp32"
  timeout 110 python3 benchmarks/fidelity.py --model-path /tmp/smol.gguf --attention-backend torch \
    --dtype float32 --shadowkv-rank "$1" --shadowkv-min-budget-chunks "$2" --out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1; echo "$name rc=$?"; tail -1 "$OUT/$name.log"
done
