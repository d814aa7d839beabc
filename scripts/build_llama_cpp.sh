#!/usr/bin/env bash
# Build llama.cpp's CPU tools that serve a DFlash drafter (docs/llama-cpp.md), from the llama.cpp source that
# PyPI's llama-cpp-python sdist vendors (PyPI has no prebuilt llama.cpp with the speculative tools). The Python
# binding itself is not built or used: only the vendored tree's CLI tools, with CMake, CPU only.
#
# Binaries land in ${DFLASH_LLAMA_CPP_CACHE:-~/.cache/dflash-fast/llama.cpp}/<version>/bin, each copied there as
# soon as it is built; a tool already there is reused as is. Prints the bin directory on its last line of stdout.
#
#   scripts/build_llama_cpp.sh            # llama-cpp-python 0.3.36, jobs = 2: the three tools below
#   scripts/build_llama_cpp.sh llama-speculative-simple llama-simple    # only these (what the tests run)
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 LLAMA_CPP_JOBS=2 scripts/build_llama_cpp.sh
set -euo pipefail
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
jobs="${LLAMA_CPP_JOBS:-2}"
cache="${DFLASH_LLAMA_CPP_CACHE:-$HOME/.cache/dflash-fast/llama.cpp}"
root="$cache/$version"
bin="$root/bin"
tools=("$@")
[ "${#tools[@]}" -gt 0 ] || tools=(llama-speculative-simple llama-simple llama-server)
have_all=1
for t in "${tools[@]}"; do [ -x "$bin/$t" ] || have_all=0; done
if [ "$have_all" -eq 1 ]; then
  echo "llama.cpp tools cached: $bin" >&2
  echo "$bin"
  exit 0
fi
mkdir -p "$root/src"
sdist="$root/src/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
  python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$root/src" \
    || { echo "error: pip could not fetch the llama-cpp-python==$version sdist; check the network or set LLAMA_CPP_PYTHON_VERSION" >&2; exit 1; }
fi
src="$root/src/llama_cpp_python-$version/vendor/llama.cpp"
[ -d "$src" ] || tar -xzf "$sdist" -C "$root/src"
[ -f "$src/CMakeLists.txt" ] \
  || { echo "error: $sdist holds no vendor/llama.cpp; pick a llama-cpp-python version that vendors llama.cpp" >&2; exit 1; }
start=$(date +%s)
cmake -S "$src" -B "$root/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF >"$root/cmake.log" 2>&1 \
  || { echo "error: cmake configure failed; see $root/cmake.log" >&2; exit 1; }
mkdir -p "$bin"
for t in "${tools[@]}"; do
  [ -x "$bin/$t" ] && continue
  cmake --build "$root/build" -j "$jobs" --target "$t" >>"$root/build.log" 2>&1 \
    || { echo "error: llama.cpp build of $t failed; see $root/build.log" >&2; exit 1; }
  cp "$root/build/bin/$t" "$bin/$t.tmp" && mv "$bin/$t.tmp" "$bin/$t"
  echo "built $t after $(( $(date +%s) - start ))s" >&2
done
echo "built llama.cpp tools in $(( $(date +%s) - start ))s with -j$jobs: $bin" >&2
echo "$bin"
