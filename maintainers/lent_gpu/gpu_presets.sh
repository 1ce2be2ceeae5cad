#!/usr/bin/env bash
# Every random model preset served on a lent 2-GPU machine, one SGLang-client smoke run each
# (smoke_8k: 2 documents of 8K, 2 questions each): full attention on GPU 0 beside ShadowKV on
# GPU 1, which compresses every prompt (--shadowkv-compress-policy eager) so that each family's
# compression and sparse decode run. Each side keeps one Triton cache across its presets.
#   bash maintainers/lent_gpu/gpu_presets.sh [PRESET...]    # carry .whl-srv .whl-bench .sglmin .tok
set -u
cd "$(dirname "$0")/../.." || exit 1  # the repository root
mkdir -p "$OUT" /tmp/presets
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$@" 2>&1 | grep -v "Target directory"; }
[ -d /tmp/site/fastapi ] || pipi .whl-srv/*.whl
[ -d /tmp/site/pybase64 ] || pipi .whl-bench/*.whl
presets=("${@:-qwen2.5-7b qwen3-8b glm-4-9b phi-3-mini}")
side() {  # GPU MODE FLAGS...: every preset in turn on one GPU
  local gpu=$1 mode=$2; shift 2
  for preset in ${presets[*]}; do
    CUDA_VISIBLE_DEVICES=$gpu python3 benchmarks/sglang_client_bench.py --client .sglmin/sglang_bench.py \
      --tokenizer "$PWD/.tok" --model-path "random:$preset" --modes "$mode" --workloads smoke_8k \
      --triton-cache "/tmp/triton-$mode" --startup-timeout 240 --workload-timeout 90 "$@" \
      --out "/tmp/presets/${mode}_${preset}.json" > "/tmp/presets/${mode}_${preset}.log" 2>&1
  done
}
side 0 full &
side 1 shadowkv --server-flag=--shadowkv-compress-policy --server-flag=eager &
wait
tail -n 3 /tmp/presets/*.log
tar czf "$OUT/presets.tgz" -C /tmp presets  # one file: a call brings back 8
