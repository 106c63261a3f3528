#!/usr/bin/env bash
# Runs on the build machine: builds bench_cuda once per kernel variant (src/backend/cuda from each
# git ref) and puts the stripped binaries in build-variants/, for a side-by-side timing on the GPU
# host (each binary's --attention mode runs the default attention at 32k causal three times):
#   scripts/gpu/stage_variants.sh main bwd-fa3-order     # on the build machine: git refs
#   # copy the repository with build-variants/ and build-bundle/ (scripts/gpu/stage.sh: the
#   # runtime libraries) to the GPU host, then there:
#   export LD_LIBRARY_PATH=$PWD/build-bundle/lib
#   for v in build-variants/bench_*; do echo $v; $v --attention | grep bwd; done
# VARIANT_TARGETS="bench_cuda test_cuda_ops" stages the op tests of each ref too (test_cuda_ops_REF).
# The working tree's src/backend/cuda must be clean; it is restored afterwards.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD:-build-cuda}
[[ $# -gt 0 ]] || { echo "usage: $0 REF [REF...]" >&2; exit 2; }
git diff --quiet HEAD -- src/backend/cuda || { echo "stage_variants: src/backend/cuda has local changes" >&2; exit 1; }
restore() { git checkout -q HEAD -- src/backend/cuda; }
trap restore EXIT
mkdir -p build-variants
for ref in "$@"; do
  git checkout -q "$ref" -- src/backend/cuda
  targets=(${VARIANT_TARGETS:-bench_cuda})
  cmake --build "$build" --target "${targets[@]}" -j "$(nproc)" > /tmp/stage_variants.log 2>&1 || { tail -20 /tmp/stage_variants.log; exit 1; }
  grep -E "C75|spill stores" /tmp/stage_variants.log | grep -v " 0 bytes spill" || true
  for t in "${targets[@]}"; do
    name=${t/bench_cuda/bench}
    strip -o "build-variants/${name}_${ref//\//_}" "$(find "$build" -type f -name "$t" -perm -u+x | head -1)"
  done
  restore
done
du -sh build-variants
