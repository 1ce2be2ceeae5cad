#!/usr/bin/env bash
# untracked: A/B of the .variant package against the working tree on the lent GPU
set -u
mkdir -p "$OUT"
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-fi2/*.whl .whl-srv/*.whl .whl-bench/*.whl .whl-test/*.whl
rm -rf /tmp/v /tmp/m; mkdir -p /tmp/v /tmp/m
cp -r benchmarks .tok /tmp/v/; cp -r benchmarks .tok /tmp/m/
cp -r .variant/sglang_shadowkv .variant/tests /tmp/v/; cp -r sglang_shadowkv tests /tmp/m/
export HF_HUB_OFFLINE=1 MAX_JOBS=16
case "$1" in
  tests)
    (cd /tmp/m && PYTHONPATH=/tmp/site:/tmp/m timeout 280 python3 -m pytest -q -x -p no:cacheprovider tests/test_shadowkv_kernels.py 2>&1 | tail -4)
    (cd /tmp/v && PYTHONPATH=/tmp/site:/tmp/v timeout 280 python3 -m pytest -q -x -p no:cacheprovider tests/test_shadowkv_kernels.py 2>&1 | tail -6) ;;
  cah)
    shift; order="$1"; shift
    for x in $order; do
      d=/tmp/${x:0:1}
      (cd $d && PYTHONPATH=/tmp/site:$d timeout 200 python3 benchmarks/cold_and_hit.py --model-path random:llama-3.1-8b --tokenizer-path .tok "$@" --out $OUT/cah_$x.json 2>&1 | tail -8)
    done ;;
esac
