#!/usr/bin/env bash
# Gathers, on a machine with the package registries, what the two GPU-host runs beside this file
# need on a host that has torch, Triton and CUDA but reaches no registry:
#   .whl/            the server's pure-Python and binary wheels for CPython 3.12 (torch stays the host's)
#   .trees/c6bd547/  the baseline tree of the c64 serving bar (issue 26)
#   .trees/split/    split_sitecustomize.py as sitecustomize.py (the attention split A/B)
#   .trees/sw/       a sitecustomize.py that sets a 0.5 ms GIL switch interval (the hand-off A/B)
#   .trees/llama.cpp llama.cpp's source from llama-cpp-python's sdist, less its docs, tests, vocab
#                    files and GPU backends (~27 MB), to build llama-server there
#   .trees/gguf/     skeletons of the embedded SmolLM2 GGUF and the pulled qwen2.5-coder:0.5b
#                    (random_gguf.py builds random-weight copies of them there)
# Both folders are git-ignored through .git/info/exclude. Run from the repository root after
# `make install models`:  bash benchmarks/gpu_host/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.trees/' .git/info/exclude 2>/dev/null || echo '/.trees/' >> .git/info/exclude
PY=.venv/bin/python
mkdir -p .whl .trees/split .trees/sw .trees/gguf
rm -rf .whl && mkdir -p .whl  # one version of each: two stop the install there
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  starlette uvicorn httptools uvloop orjson llguidance prometheus_client imagesize gguf httpx \
  httpcore anyio h11 click idna certifi
rm -rf .trees/c6bd547 && mkdir -p .trees/c6bd547 && git archive c6bd547 src | tar -x -C .trees/c6bd547
cp benchmarks/gpu_host/split_sitecustomize.py .trees/split/sitecustomize.py
printf 'import sys\n\nsys.setswitchinterval(0.0005)\n' > .trees/sw/sitecustomize.py
if [ ! -d .trees/llama.cpp ]; then
  tmp=$(mktemp -d)
  $PY -m pip download -q llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d "$tmp"
  tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
  src="$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp"
  mkdir -p .trees/llama.cpp
  (cd "$src" && tar -c --exclude=./docs --exclude=./models --exclude=./tests --exclude=./examples \
    --exclude=./media --exclude=./benches --exclude=./tools/server/tests --exclude=./tools/ui/tests \
    --exclude=./tools/ui/src --exclude=./gguf-py --exclude=./conversion --exclude=.git \
    $(for b in cuda sycl vulkan opencl hexagon metal et webgpu openvino cann virtgpu; do
        echo "--exclude=./ggml/src/ggml-$b"; done) .) | tar -x -C .trees/llama.cpp
  rm -rf "$tmp"
fi
$PY benchmarks/random_gguf.py skeleton "$($PY -c 'from turbospark.engine.loader import default_model_path as d; print(d())')" .trees/gguf/smollm2.json.gz
$PY benchmarks/random_gguf.py skeleton "$($PY -c 'from turbospark.engine.loader import resolve_model_spec as r; print(r("qwen2.5-coder:0.5b")[1])')" .trees/gguf/qwen05.json.gz
du -sh .whl .trees
