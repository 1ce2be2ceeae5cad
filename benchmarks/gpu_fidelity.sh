#!/usr/bin/env bash
# Fidelity sweep on the device in float32 (torch attention backend; ShadowKV kernels in Triton).
# Expects the embedded GGUF at /tmp/smol.gguf. Each argument "RANK MIN_BUDGET_CHUNKS" is one run:
#   bash benchmarks/gpu_fidelity.sh "30 32" "96 192"
export PYTHONPATH=/tmp/site:.
mkdir -p "$OUT"
for cfg in "$@"; do
  read -r rank budget <<< "$cfg"
  name="fidelity_r${rank}_b${budget}_gpu_fp32"
  timeout 170 python3 benchmarks/fidelity.py --model-path /tmp/smol.gguf --attention-backend torch \
    --dtype float32 --shadowkv-rank "$rank" --shadowkv-min-budget-chunks "$budget" --out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1; echo "$name rc=$?"; tail -1 "$OUT/$name.log"
done
