#!/usr/bin/env bash
# llama-cpp-python built for an AVX2-only CPU (AVX, AVX2, FMA, F16C, BMI2; no AVX-512, AVX-VNNI or AMX),
# from the peers' sdist, into its own venv: the llama.cpp an AVX2-only EPYC would run, to time beside our
# AVX2 paths on a wider CPU (GPTOSS_LITE_CPU=avx2, docs/kernels.md#imitating-an-avx2-only-cpu).
#
#   bash benchmarks/llama_avx2.sh            # ~/.cache/gptoss-lite-peers/venvs/llama-avx2, about 10 minutes
#
# Needs the sdist the peers' setup fetched ($PEERS_WORK/sdist) and a package index with its build
# dependencies (scikit-build-core, cmake, ninja). Writes the build log beside the peers' logs; a venv
# that already imports the version is left as it is.
set -euo pipefail
W="${PEERS_WORK:-$HOME/.cache/gptoss-lite-peers}"
VER="${LLAMA_VER:-0.3.36}"
VENV="$W/venvs/llama-avx2"
SDIST="$W/sdist/llama_cpp_python-$VER.tar.gz"
[ -f "$SDIST" ] || { echo "no $SDIST: run the peers' setup first (../shared/peers/setup_peers.sh llama)" >&2; exit 2; }
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp; assert llama_cpp.__version__ == '$VER'" 2>/dev/null; then
  echo "$VENV already has llama-cpp-python $VER"
  exit 0
fi
python3 -m venv "$VENV"
mkdir -p "$W/logs"
ISA="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
ISA="$ISA -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF"
ISA="$ISA -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
CMAKE_ARGS="$ISA -DLLAVA_BUILD=OFF -DCMAKE_BUILD_TYPE=Release" CMAKE_BUILD_PARALLEL_LEVEL=2 \
  "$VENV/bin/pip" install -v --no-cache-dir "$SDIST" > "$W/logs/llama_avx2_build.log" 2>&1
"$VENV/bin/python" -c "import llama_cpp; print('built', llama_cpp.__version__, llama_cpp.llama_print_system_info().decode())"
