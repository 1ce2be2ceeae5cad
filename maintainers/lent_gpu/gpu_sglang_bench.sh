#!/usr/bin/env bash
# SGLang's own serving client against this server on the lent H100 (random-weight Llama-3.1-8B shape,
# FlashInfer), one part per device call (each under the 10-minute limit; a machine kept warm keeps
# /tmp and FlashInfer's JIT cache between calls made within 30 s of each other):
#   bash maintainers/lent_gpu/gpu_sglang_bench.sh install1          # carry .whl-fi1
#   bash maintainers/lent_gpu/gpu_sglang_bench.sh check             # carry .whl-fi2 .whl-srv .whl-bench .whl-test .sglmin .tok
#   bash maintainers/lent_gpu/gpu_sglang_bench.sh MODE TAG WORKLOAD...   # full|shadowkv; same carries;
#                                                   #   HICACHE=1 turns the host tier on, WT=S the workload timeout
#   bash maintainers/lent_gpu/gpu_sglang_bench.sh script benchmarks/X.py ARGS...  # any benchmark; same carries
#   bash maintainers/lent_gpu/gpu_sglang_bench.sh triton MODE TAG WORKLOAD... # no FlashInfer (Triton backend), the
#                                                   #   host tier on; carry .whl-srv .whl-bench .sglmin .tok
# Staging here first (see ../shared/device/): fetch_flashinfer_wheels.sh, fetch_server_wheels.sh,
# stage_sglang_bench.sh, the embedded tokenizer saved to .tok, pytest and hypothesis wheels in .whl-test.
# Then here: python benchmarks/sglang_client_bench.py --merge sglang_bench_*.json --out benchmarks/results/...
set -u
cd "$(dirname "$0")/../.." || exit 1  # the repository root
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 MAX_JOBS=16
install() {
  # a fresh machine (the last one went back after 30 s idle) has no FlashInfer: without it the
  # server runs the Triton backend and every number is off, so stop before spending device time
  [ -d /tmp/site/flashinfer ] || { echo "FlashInfer is not installed on this machine: run install1 (carry .whl-fi1) first"; exit 3; }
  [ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    .whl-fi2/*.whl .whl-srv/*.whl .whl-bench/*.whl .whl-test/*.whl
}
client_bench() {  # MODE TAG FLAG...: sglang_client_bench.py, one mode, its report and log in $OUT
  local mode=$1 tag=$2; shift 2
  timeout 570 python3 benchmarks/sglang_client_bench.py --client .sglmin/sglang_bench.py --tokenizer "$PWD/.tok" \
    --modes "$mode" "$@" --out "$OUT/sglang_bench_${mode}_$tag.json" > "$OUT/sglang_bench_${mode}_$tag.log" 2>&1
  echo "rc=$?"; grep -v "Warning\|warn(" "$OUT/sglang_bench_${mode}_$tag.log" | tail -12
}
case "$1" in
  install1) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-fi1/*.whl; echo "rc=$?" ;;
  check) install
         nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
         timeout 400 python3 -m pytest -q -x -p no:cacheprovider tests/test_shadowkv_kernels.py 2>&1 | tail -15 ;;
  script)
    install; shift
    timeout 570 python3 "$@" 2>&1 | tail -40; echo "rc=${PIPESTATUS[0]}" ;;
  triton)  # one mode, the host tier on (both modes' baseline in the cache hierarchy's comparisons)
    [ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      .whl-srv/*.whl .whl-bench/*.whl
    client_bench "$2" "$3" --workload-timeout "${WT:-540}" --server-flag=--enable-hierarchical-cache --server-log \
      --workloads "${@:4}" ;;
  full|shadowkv)
    install
    # a fresh machine compiles FlashInfer's modules at the first server's first steps: beside the
    # host tier's and ShadowKV's pinned memory the compiler's jobs were killed for memory (H100,
    # 125 GiB), so warm the JIT cache without the host tier first
    if [ -n "${HICACHE:-}" ] && [ ! -d "$HOME/.cache/flashinfer" ]; then client_bench full jitwarm --workloads smoke_8k; fi
    client_bench "$1" "$2" --workload-timeout "${WT:-300}" ${HICACHE:+--server-flag=--enable-hierarchical-cache} \
      --workloads "${@:3}" ;;
esac
