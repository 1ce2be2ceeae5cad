#!/usr/bin/env bash
# Tensor parallelism on a lent multi-GPU machine (nvidia-h200-x4 or -h100-x4), one part per call:
#   bash maintainers/lent_gpu/gpu_tp.sh check       # carry .whl-mini .tok: benchmarks/tensor_parallel.py
#                                                   #   (TP=2 against TP=1 tokens, Triton, float32)
#   bash maintainers/lent_gpu/gpu_tp.sh install1    # carry .whl-fi1: FlashInfer's wheel (62 MB: a call of its own)
#   bash maintainers/lent_gpu/gpu_tp.sh allreduce   # benchmarks/all_reduce.py over every GPU (no carry)
#   bash maintainers/lent_gpu/gpu_tp.sh tp8b        # carry .whl-srv .whl-bench .sglmin .tok (and .whl-fi2 within
#                                                   #   30 s of install1: /tmp stays): 8B shape, TP=1 on GPU 0
#                                                   #   beside TP=2 on GPUs 1-2 (after it, on a 2-GPU machine),
#                                                   #   full attention, SGLang's client
#   WT=300 bash maintainers/lent_gpu/gpu_tp.sh 70b TP WORKLOADS...   # carry .whl-srv .whl-bench .sglmin .tok:
#                                                   #   70B shape, full attention on the first TP GPUs beside
#                                                   #   ShadowKV on the next TP (WT: each workload's time limit)
# .whl-mini: the orjson and pyzmq wheels of .whl-srv (what the Engine needs beyond the image).
set -u
cd "$(dirname "$0")/../.." || exit 1  # the repository root
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 MAX_JOBS=16 PYTHONUNBUFFERED=1
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$@"; }
bench() {  # GPUS MODE MODEL TP TAG WORKLOADS...: one sglang_client_bench run, in the background
  local gpus=$1 mode=$2 model=$3 tp=$4 tag=$5; shift 5
  CUDA_VISIBLE_DEVICES=$gpus python3 benchmarks/sglang_client_bench.py --client .sglmin/sglang_bench.py \
    --tokenizer "$PWD/.tok" --model-path "$model" --modes "$mode" --workloads "$@" --workload-timeout "${WT:-420}" \
    --server-flag=--tp-size --server-flag="$tp" --out "$OUT/sglang_bench_${tag}.json" > "$OUT/${tag}.log" 2>&1 &
}
case "$1" in
  install1) pipi .whl-fi1/*.whl; echo "rc=$?" ;;
  smoke)  # a TP=2 server on the 1B shape (carry .whl-srv .tok), a few requests, the log
    [ -d /tmp/site/fastapi ] || pipi .whl-srv/*.whl
    shift
    setsid python3 -m sglang_shadowkv.launch_server --model-path random:llama-3.2-1b --tokenizer-path .tok \
      --tp-size 2 --port 30500 --log-level info --watchdog-timeout 40 --check-integrity "$@" > "$OUT/smoke.log" 2>&1 &
    for _ in $(seq 120); do curl -sf localhost:30500/health > /dev/null && break; sleep 1; done
    for n in 16 3000 3000; do
      python3 -c "import json,random; print(json.dumps({'input_ids': [random.randrange(10, 40000) for _ in range($n)], 'sampling_params': {'max_new_tokens': 16, 'temperature': 0}}))" > /tmp/body.json
      timeout 60 curl -s localhost:30500/generate -H 'content-type: application/json' -d @/tmp/body.json | head -c 300; echo
    done
    curl -s localhost:30500/get_server_info | head -c 600; echo
    pkill -TERM -f launch_server; sleep 5; grep -v "Warning\|warn(" "$OUT/smoke.log" | tail -70 ;;
  check)
    pipi .whl-mini/*.whl; echo "install rc=$?"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nvidia-smi topo -m | head -6
    shift
    python3 benchmarks/tensor_parallel.py --tokenizer-path .tok --out "$OUT/tensor_parallel_check.json" \
      --log-level info "$@" > "$OUT/tensor_parallel_check.log" 2>&1 &
    pid=$!; for _ in $(seq ${CHECK_S:-200}); do kill -0 $pid 2>/dev/null || break; sleep 1; done
    if kill -0 $pid 2>/dev/null; then  # a hang: every process's stacks into the log, then stop
      pkill -USR1 -f "tensor_parallel.py|spawn_main"; sleep 3; pkill -9 -f "tensor_parallel.py|spawn_main"; fi
    wait $pid; echo "check rc=$?"; grep -v "Warning\|warn(" "$OUT/tensor_parallel_check.log" | tail -60 ;;
  allreduce)
    nvidia-smi topo -m | head -6
    python3 benchmarks/all_reduce.py --world-size "$(nvidia-smi -L | wc -l)" --out "$OUT/all_reduce.json" ;;
  tp8b)  # FlashInfer if install1 ran (then carry .whl-fi2 too), else the Triton backend at both sizes
    [ -d /tmp/site/fastapi ] || pipi .whl-srv/*.whl
    [ -d /tmp/site/pybase64 ] || pipi .whl-bench/*.whl
    [ -d /tmp/site/flashinfer ] && [ ! -d /tmp/site/tvm_ffi ] && pipi .whl-fi2/*.whl
    gpus=1,2
    bench 0 full random:llama-3.1-8b 1 tp1_8b decode_32k_x8 cold_32k
    [ "$(nvidia-smi -L | wc -l)" -lt 3 ] && { wait; gpus=0,1; }  # two GPUs: TP=2 after TP=1, not beside it
    bench $gpus full random:llama-3.1-8b 2 tp2_8b decode_32k_x8 cold_32k
    wait; tail -n 4 "$OUT"/tp1_8b.log "$OUT"/tp2_8b.log ;;
  70b)  # FlashInfer if install1 ran (then carry .whl-fi2 too), else both modes on the Triton backend
    [ -d /tmp/site/fastapi ] || pipi .whl-srv/*.whl
    [ -d /tmp/site/pybase64 ] || pipi .whl-bench/*.whl  # the client's (a smoke call leaves only the server's)
    [ -d /tmp/site/flashinfer ] && [ ! -d /tmp/site/tvm_ffi ] && pipi .whl-fi2/*.whl
    tp=$2; shift 2
    first=$(seq -s, 0 $((tp - 1))); second=$(seq -s, "$tp" $((2 * tp - 1)))
    bench "$first" full random:llama-3.1-70b "$tp" full_70b_tp$tp "$@"
    bench "$second" shadowkv random:llama-3.1-70b "$tp" shadowkv_70b_tp$tp "$@"
    wait; tail -n 6 "$OUT"/full_70b_tp$tp.log "$OUT"/shadowkv_70b_tp$tp.log ;;
esac
