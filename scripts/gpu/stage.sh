#!/usr/bin/env bash
# Runs on the build machine (Debian, CUDA toolkit, spindle configured with -DSPINDLE_CUDA=ON), not on
# the GPU host. Builds the targets and puts stripped copies of them, plus the runtime libraries a
# stock CUDA/PyTorch GPU host lacks (Gloo and its dependencies, utf8proc, yaml-cpp, fmt), into the
# bundle folder build-bundle/ (bin/ and lib/; git-ignored). Copy the repository with that folder to
# the GPU host and run, from the repository root there, scripts/gpu/gpu_run.sh (or perf_run.sh,
# max_context.sh, scaling.sh, dpo_gpu.sh), which take the binaries from the bundle.
# usage: scripts/gpu/stage.sh [BUILD_DIR]   (default: build)
#   BUNDLE_DIR=dir     where the bundle goes (default build-bundle)
#   BUNDLE_MAX_MB=n    fail if the bundle is larger (for a copy with a size limit; each CUDA test
#                      binary is ~9 MB of fat kernels, so narrow STAGE_TARGETS to fit)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
# STAGE_TARGETS chooses what is built and staged (e.g. "test_cuda_ops bench_cuda" for attention
# work); the default, everything gpu_run.sh's parts tests/check/sft/eval/bench run, leaves out
# bench_cuda (its attn part), which keeps the bundle under 64 MiB.
targets=(${STAGE_TARGETS:-spindle test_cuda_ops test_cuda_model test_cuda_memory test_cuda_streams test_nccl})
cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"
stage=${BUNDLE_DIR:-build-bundle}
rm -rf "$stage" && mkdir -p "$stage/bin" "$stage/lib"
for t in "${targets[@]}"; do
  f=$(find "$build" -type f -name "$t" -perm -u+x | head -1)
  [[ -n "$f" ]] || { echo "stage: $t not built" >&2; exit 1; }
  strip -o "$stage/bin/$t" "$f"
done
# Libraries spindle links that a stock CUDA/PyTorch host may not have (each copied when the build
# machine has it).
for lib in libgloo.so.0 libhiredis.so.0.14 libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200 libutf8proc.so.2 \
           libyaml-cpp.so.0.7 libfmt.so.9 libprotobuf-lite.so.32 libisal.so.2; do
  src=$(ldconfig -p | awk -v n="$lib" '$1 == n && !found {print $NF; found = 1}')
  if [[ -n "$src" ]]; then cp -L "$src" "$stage/lib/"; fi
done
du -sh "$stage"
if [[ -n "${BUNDLE_MAX_MB:-}" ]] && (( $(du -sm "$stage" | cut -f1) > BUNDLE_MAX_MB )); then
  echo "stage: $stage is larger than BUNDLE_MAX_MB=$BUNDLE_MAX_MB MiB; narrow STAGE_TARGETS" >&2
  exit 1
fi
