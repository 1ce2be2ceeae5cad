#!/usr/bin/env bash
# Fidelity sweep on the device in float32 (torch attention backend; ShadowKV kernels in Triton).
# Expects the embedded GGUF at /tmp/smol.gguf. Each argument is one run: "RANK MIN_BUDGET_CHUNKS",
# then optionally more fidelity.py flags (short names in the file name: o outliers, w local
# window, c chunk size; an int8 value dtype as _int8, int8 landmarks as _lint8):
#   bash maintainers/lent_gpu/gpu_fidelity.sh "30 32" "160 192 --shadowkv-outliers 96"
cd "$(dirname "$0")/../.." || exit 1  # the repository root
export PYTHONPATH=/tmp/site:.
mkdir -p "$OUT"
for cfg in "$@"; do
  read -r rank budget extra <<< "$cfg"
  tag=$(sed -e 's/--shadowkv-outliers /_o/; s/--shadowkv-local-window /_w/; s/--shadowkv-chunk-size /_c/; s/--shadowkv-value-dtype /_/; s/--shadowkv-landmark-dtype /_l/; s/ //g' <<< "$extra")
  name="fidelity_r${rank}_b${budget}${tag}_gpu_fp32"
  # shellcheck disable=SC2086 # extra holds several flags
  timeout 170 python3 benchmarks/fidelity.py --model-path /tmp/smol.gguf --attention-backend torch \
    --dtype float32 --shadowkv-rank "$rank" --shadowkv-min-budget-chunks "$budget" $extra --out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1; echo "$name rc=$?"; tail -1 "$OUT/$name.log"
done
