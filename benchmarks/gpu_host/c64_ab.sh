#!/bin/bash
# Issue 26's c64 serving A/B on a GPU host, in one command of under 10 minutes, from the repository
# root after prepare.sh (its .whl and .trees beside the tree): the CUDA decode attention alone per
# context split, then `bench_serving.py --serve` at concurrency 64 (256 requests, 64-token prompts,
# 256 output tokens) on a random Llama-3.1-8B folder, servers in turn: this tree, c6bd547, this tree
# with a 0.5 ms GIL switch interval, this tree with the attention split aimed at 4 programs per SM;
# then the three again. Each run's summary JSON goes to $OUT (default /tmp/bench-out).
OUT=${OUT:-/tmp/bench-out}; mkdir -p "$OUT"
START=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; lscpu | grep 'Model name'
PYTHONPATH=/tmp/site:src python3 benchmarks/random_model.py --config llama-3.1-8b --out /tmp/rl 2>&1 | tail -2
echo "folder built at +$(( $(date +%s) - START )) s"
PYTHONPATH=/tmp/site:src timeout 60 python3 benchmarks/bench_paged_attention.py --seqs 16,32,64,128 --contexts 128,256,512 2>&1 | tee $OUT/paged.txt
echo "microbench done at +$(( $(date +%s) - START )) s"
ARGS="--concurrency 64 --num-prompts 256 --input-len 64 --output-len 256"
SERVE="--model /tmp/rl --device cuda --max-active 64 --max-waiting 512 --kv-cache-gb 24"
one() { # name pythonpath [env]
  local name=$1 pp=$2; shift 2
  if [ $(( $(date +%s) - START )) -gt 500 ]; then echo "skip $name (time)"; return; fi
  echo "== $name at +$(( $(date +%s) - START )) s"
  env "$@" PYTHONPATH=$pp timeout 110 python3 benchmarks/bench_serving.py --serve "$SERVE" $ARGS --result-json $OUT/$name.json 2>&1 | grep -E "completed|output token|ITL|engine: overhead|error|Error|Traceback" | head -8
}
one main1 /tmp/site:src
one c6bd547_1 /tmp/site:.trees/c6bd547/src
one sw1 .trees/sw:/tmp/site:src
one split1 .trees/split:/tmp/site:src TS_SPLIT_FACTOR=4
one main2 /tmp/site:src
one sw2 .trees/sw:/tmp/site:src
one split2 .trees/split:/tmp/site:src TS_SPLIT_FACTOR=4
echo "end at +$(( $(date +%s) - START )) s"
