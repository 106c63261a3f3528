#!/usr/bin/env bash
# Run HERE (the build machine, CUDA toolkit present): stage stripped binaries and the runtime
# libraries the GPU host lacks (Gloo and its dependencies, utf8proc, ...) into .gpubin/run/, to be
# carried by the device tool: run(command="bash .gpubin/run/gpu_run.sh", carry=[".gpubin/run"]).
# usage: scripts/gpu/stage.sh [BUILD_DIR]   (default: build; targets are built first)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
# STAGE_TARGETS chooses what is built and staged (e.g. "test_cuda_ops bench_cuda" for attention
# work); the default, everything gpu_run.sh's parts tests/check/sft/eval/bench run, leaves out
# bench_cuda (its attn part), since all of it would exceed the carry limit.
targets=(${STAGE_TARGETS:-spindle test_cuda_ops test_cuda_model test_cuda_memory test_cuda_streams test_nccl})
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"
stage=.gpubin/run
rm -rf "$stage" && mkdir -p "$stage/bin" "$stage/lib"
for t in "${targets[@]}"; do
  f=$(find "$build" -type f -name "$t" -perm -u+x | head -1)
  [[ -n "$f" ]] || { echo "stage: $t not built" >&2; exit 1; }
  strip -o "$stage/bin/$t" "$f"
done
# Libraries spindle links that a stock CUDA/PyTorch host may not have.
for lib in libgloo.so.0 libhiredis.so.0.14 libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200 libutf8proc.so.2 \
           libyaml-cpp.so.0.7 libfmt.so.9; do
  src=$(ldconfig -p | awk -v n="$lib" '$1 == n && !found {print $NF; found = 1}')
  if [[ -n "$src" ]]; then cp -L "$src" "$stage/lib/"; fi
done
cp scripts/gpu/gpu_run.sh "$stage/"
du -sh "$stage"
# The device tool carries at most 64 MiB; each CUDA test binary is ~9 MB (fat kernels).
if (( $(du -sm "$stage" | cut -f1) > 63 )); then
  echo "stage: $stage is over the 64 MiB carry limit; narrow STAGE_TARGETS" >&2
  exit 1
fi
