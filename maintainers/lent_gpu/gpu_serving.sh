#!/usr/bin/env bash
# The serving benchmark on the lent H100, one part per device call (each under its 10-minute limit;
# a warm machine keeps /tmp between calls made within 30 s of each other):
#   bash maintainers/lent_gpu/gpu_serving.sh install1        # carry .whl-fi1 (FlashInfer)
#   bash maintainers/lent_gpu/gpu_serving.sh install2        # carry .whl-fi2 .whl-srv .tok
#   bash maintainers/lent_gpu/gpu_serving.sh graph ARGS...   # bench_throughput.py: graph step times
#   bash maintainers/lent_gpu/gpu_serving.sh NAME ARGS...    # bench_serving.py --preset h100 ARGS
# Then here: python benchmarks/bench_serving.py --merge serving_*.json --graph-steps bench_throughput.json
set -u
cd "$(dirname "$0")/../.." || exit 1  # the repository root
export PYTHONPATH=/tmp/site:. MAX_JOBS=16
mkdir -p "$OUT"
part=$1
shift
case "$part" in
  install1) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-fi1/*.whl ;;
  install2) python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-fi2/*.whl .whl-srv/*.whl
            rm -rf /tmp/tok && cp -r .tok /tmp/tok ;;
  graph) python3 benchmarks/bench_throughput.py --tokenizer-path /tmp/tok --out "$OUT/bench_throughput.json" "$@" \
           > "$OUT/bench_throughput.log" 2>&1; echo "rc=$?"; tail -25 "$OUT/bench_throughput.log" ;;
  *) python3 benchmarks/bench_serving.py --preset h100 --tokenizer-path /tmp/tok --out "$OUT/serving_$part.json" "$@" \
       > "$OUT/serving_$part.log" 2>&1; echo "rc=$?"; grep -v "^INFO\|^\[" "$OUT/serving_$part.log" | tail -30 ;;
esac
