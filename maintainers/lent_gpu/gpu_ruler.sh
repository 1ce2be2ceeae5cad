#!/usr/bin/env bash
# benchmarks/ruler.py on the lent GPU (the embedded model, torch attention backend unless
# ATTENTION_BACKEND says otherwise, ShadowKV defaults
# with compression forced): one dtype per 10-minute call, every task at the given lengths, split
# over 4 processes per length (a quarter of the tasks each) that share the GPU, each pinning a
# small share of host memory for its compressed values.
# The embedded GGUF travels in two halves (gpu_defaults.sh split, here):
#   call 1:  mkdir -p /tmp/gguf && cp .gguf-part1/* /tmp/gguf/      carry [".gguf-part1"]
#   call 2:  bash maintainers/lent_gpu/gpu_ruler.sh DTYPE [LENGTH...]   carry [".gguf-part2", ".whl-srv"]
#            (DTYPE float32 or bfloat16; lengths default 4096 8192; PART_TIMEOUT=S: seconds a part may
#            run, default 560, for a call with less device time left; TASK_GROUPS="a b;c": other task
#            groups, one process each; SAMPLE_SPLIT=N: each group's 12 samples split over N processes;
#            PATHS="full full_hit": other paths than ruler.py's default; HIT_AFTER=prompt: ruler.py's
#            --hit-after; RUN_TAG=_x: a suffix to the parts directory and output names, for two runs of
#            one dtype at once; HOST_MEM_FRACTION: each process's pinned share of host memory, default
#            0.02: on four H200s (512 GiB) 72 processes at 0.02 ran out of memory, none finished a task;
#            EXACT_COPY_FRACTION: each process's share for exact copies, default 0.005, which holds an
#            8K document's copy in float32 on a 128 GiB machine (0.25, the server's default, is for one
#            process); ATTENTION_BACKEND: the engine's, default torch)
# On a two-GPU machine both dtypes run at once, one GPU each (the GGUF joined first, so that the
# two runs don't both join it):
#   . maintainers/lent_gpu/embedded_gguf.sh && embedded_gguf && \
#   CUDA_VISIBLE_DEVICES=0 bash maintainers/lent_gpu/gpu_ruler.sh float32 8192 & \
#   CUDA_VISIBLE_DEVICES=1 bash maintainers/lent_gpu/gpu_ruler.sh bfloat16 8192; wait
# -> $OUT/ruler_gpu_fp32.json or ruler_gpu_bf16.json (the parts merged: a task cut off by the time
# limit is missing) and ruler_parts_fp32.tar.gz or _bf16 (every part and log: a call returns at
# most 8 files).
# 2026-11-27 on an H200, 16 processes (both dtypes at once) finished 1-2 tasks each in 560 s: about
# 4-6 minutes a task at 4K with four processes per length and dtype beside each other. 2026-11-28 on
# two H200s, a dtype each: at 8K, 12 processes a GPU (one task each) finished 6 tasks in 565 s; the
# other 6 with SAMPLE_SPLIT=2 (12 processes a GPU) took 426-433 s.
set -u
cd "$(dirname "$0")/../.." || exit 1  # the repository root
mkdir -p "$OUT"
[ -d /tmp/srv ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/srv .whl-srv/*.whl 2>/dev/null
export PYTHONPATH=/tmp/srv:.
. maintainers/lent_gpu/embedded_gguf.sh
model=$(embedded_gguf) || exit 1
groups=("niah_single_1 niah_single_2 lookalike" "niah_single_3 niah_multikey_1 vt"
        "niah_multikey_2 niah_multikey_3 fwe" "niah_multivalue niah_multiquery cwe")
[ -n "${TASK_GROUPS:-}" ] && IFS=';' read -r -a groups <<< "$TASK_GROUPS"
dtype=${1:?"DTYPE: float32 or bfloat16"}
lengths=("${@:2}")
[ ${#lengths[@]} -eq 0 ] && lengths=(4096 8192)
short=$([ "$dtype" = float32 ] && echo fp32 || echo bf16)${RUN_TAG:-}
parts=/tmp/ruler_parts_$short
rm -rf "$parts" && mkdir -p "$parts"
split=${SAMPLE_SPLIT:-1}
per_part=$(( (12 + split - 1) / split ))
for length in "${lengths[@]}"; do
  for i in "${!groups[@]}"; do
    for ((s = 0; s < split; s++)); do
      first=$((s * per_part))
      count=$((12 - first < per_part ? 12 - first : per_part))
      [ "$count" -gt 0 ] || continue
      # shellcheck disable=SC2086
      timeout "${PART_TIMEOUT:-560}" python3 benchmarks/ruler.py --model-path "$model" --attention-backend "${ATTENTION_BACKEND:-torch}" \
        --dtype "$dtype" --lengths "$length" --tasks ${groups[$i]} --shadowkv-host-mem-fraction "${HOST_MEM_FRACTION:-0.02}" \
        --shadowkv-exact-copy-fraction "${EXACT_COPY_FRACTION:-0.005}" \
        --first-sample "$first" --samples "$count" ${PATHS:+--paths $PATHS} ${HIT_AFTER:+--hit-after $HIT_AFTER} \
        --out "$parts/part_${length}_${i}_$s.json" > "$parts/part_${length}_${i}_$s.log" 2>&1 &
    done
  done
done
wait
python3 benchmarks/ruler.py --merge "$parts"/part_*.json --out "$OUT/ruler_gpu_$short.json"
tar -czf "$OUT/ruler_parts_$short.tar.gz" -C "$parts" .
grep -h "Error" "$parts"/part_*.log | sort | uniq -c | head
