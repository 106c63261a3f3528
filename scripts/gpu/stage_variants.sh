#!/usr/bin/env bash
# Run HERE: build bench_cuda once per kernel variant and stage them in .gpubin/var/ for a
# side-by-side timing in one device call (each binary's --attention mode runs the default
# attention at 32k causal three times):
#   scripts/gpu/stage_variants.sh main bwd-fa3-order     # git refs; src/backend/cuda from each
#   run(command='for v in .gpubin/var/bench_*; do echo $v; $v --attention | grep bwd; done',
#       carry=[".gpubin/run", ".gpubin/var"])               # .gpubin/run from stage.sh (libraries)
# VARIANT_TARGETS="bench_cuda test_cuda_ops" stages the op tests of each ref too (test_cuda_ops_REF).
# The working tree's src/backend/cuda must be clean; it is restored afterwards.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${BUILD:-build-cuda}
[[ $# -gt 0 ]] || { echo "usage: $0 REF [REF...]" >&2; exit 2; }
git diff --quiet HEAD -- src/backend/cuda || { echo "stage_variants: src/backend/cuda has local changes" >&2; exit 1; }
restore() { git checkout -q HEAD -- src/backend/cuda; }
trap restore EXIT
mkdir -p .gpubin/var
for ref in "$@"; do
  git checkout -q "$ref" -- src/backend/cuda
  targets=(${VARIANT_TARGETS:-bench_cuda})
  cmake --build "$build" --target "${targets[@]}" -j "$(nproc)" > /tmp/stage_variants.log 2>&1 || { tail -20 /tmp/stage_variants.log; exit 1; }
  grep -E "C75|spill stores" /tmp/stage_variants.log | grep -v " 0 bytes spill" || true
  for t in "${targets[@]}"; do
    name=${t/bench_cuda/bench}
    strip -o ".gpubin/var/${name}_${ref//\//_}" "$(find "$build" -type f -name "$t" -perm -u+x | head -1)"
  done
  restore
done
du -sh .gpubin/var
