#!/usr/bin/env bash
# Build and install llama-cpp-python, with the llama.cpp and ggml it vendors, into a Python environment.
#
#   native/build.sh PYTHON [cpu|cuda|metal]
#
# cpu (default) builds ggml for the CPU it runs on (GGML_NATIVE: AVX2, AVX-512 ... as the machine has).
# cuda and metal add the GPU backend; those builds skip pip's wheel cache, which cannot tell a GPU build
# from a CPU one of the same version. The version comes from constraints.txt.
set -euo pipefail
python=${1:?usage: native/build.sh PYTHON [cpu|cuda|metal]}
flavour=${2:-cpu}
root="$(cd "$(dirname "$0")/.." && pwd)"
case "$flavour" in
  cpu)   cmake_args="-DGGML_NATIVE=ON"; cache=() ;;
  cuda)  cmake_args="-DGGML_CUDA=ON"; cache=(--no-cache-dir --force-reinstall --no-deps) ;;
  metal) cmake_args="-DGGML_METAL=ON"; cache=(--no-cache-dir --force-reinstall --no-deps) ;;
  *) echo "native/build.sh: unknown flavour '$flavour' (cpu, cuda or metal)" >&2; exit 2 ;;
esac
echo "building llama-cpp-python ($flavour: CMAKE_ARGS=$cmake_args); the first build takes about 5 minutes on 2 cores" >&2
CMAKE_ARGS="$cmake_args" "$python" -m pip install --quiet "${cache[@]}" -c "$root/constraints.txt" llama-cpp-python
"$python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'GPU offload:', bool(llama_cpp.llama_supports_gpu_offload()))"
