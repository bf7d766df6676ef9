#!/bin/bash
# Issue 27 on a host CPU with AMX (a GPU host's, where the real GGUFs cannot travel), from the
# repository root after prepare.sh, in under 10 minutes: builds llama-server for AVX-512 + VNNI + BF16
# with AMX off (its AMX build crashed on multi-token prompts on that kind) on 14 cores while the
# engine alone runs torch's kernels against the native ones on the other two (bench_native_ab.py),
# then prefill and decode through the API, turbospark (default flags, and --cpu-kernels
# bf16-native) against llama-server, both on cores 0-1 with 2 threads, on random-weight GGUFs of
# SmolLM2 (Q4_1) and qwen2.5-coder:0.5b (the pulled file's types) built from the skeletons.
START=$(date +%s)
ROOT=$PWD
el() { echo "+$(( $(date +%s) - START )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$ROOT/src PYTHONUNBUFFERED=1
lscpu | grep -E 'Model name|^CPU\(s\)|L3'; lscpu | grep -o -E 'amx[a-z_0-9]*|avx512_fp16|avx512_bf16|avx512_vnni' | sort -u | tr '\n' ' '; echo
python3 -c "import torch;print(torch.__version__, torch.backends.cpu.get_cpu_capability())"
which cc gcc
mkdir -p /tmp/lcb && cd /tmp/lcb
cmake -G Ninja $ROOT/.trees/llama.cpp -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF > /tmp/cmake.log 2>&1 || { tail -30 /tmp/cmake.log; exit 1; }
taskset -c 2-15 ninja -j14 llama-server > /tmp/ninja.log 2>&1 &
NINJA=$!
cd $ROOT
python3 benchmarks/random_gguf.py build .trees/gguf/smollm2.json.gz /tmp/smollm2-r.gguf
python3 benchmarks/random_gguf.py build .trees/gguf/qwen05.json.gz /tmp/qwen05-r.gguf
echo "ggufs built $(el)"
# meanwhile, on two cores the build does not use: the engine alone, native kernels against torch's
taskset -c 0,1 timeout 240 python3 benchmarks/bench_native_ab.py --threads 2 --quant int4,int8 --rounds 2 --new-tokens 48 --settings "TURBOSPARK_CPU_KERNELS=auto;TURBOSPARK_NATIVE_KERNELS=on;TURBOSPARK_CPU_KERNELS=bf16-native" 2>&1 | tail -12
echo "native A/B done $(el)"
wait $NINJA; echo "ninja rc=$? $(el)"; tail -3 /tmp/ninja.log
LS=/tmp/lcb/bin/llama-server
[ -x $LS ] || { tail -40 /tmp/ninja.log; exit 1; }
taskset -c 0,1 timeout $(( 580 - ($(date +%s) - START) )) python3 benchmarks/bench_api_peer.py --llama-server $LS --gguf /tmp/smollm2-r.gguf --gguf /tmp/qwen05-r.gguf --threads 2 --rounds 3 --variants " ;--cpu-kernels bf16-native" 2>&1 | grep -v "^INFO\|^WARNING" | tail -30
echo "end $(el)"
