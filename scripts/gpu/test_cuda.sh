#!/usr/bin/env bash
# Runs on the GPU host, from anywhere: builds there (scripts/gpu/build.sh) and runs the CUDA op
# tests and the kernel benchmark, writes logs under ${OUT:-out} (host.txt, build.log, test_*.log,
# bench_*.log), and prints a short table last.
#   PREBUILT=dir  also run binaries built elsewhere (dir/tests/cuda/{test_cuda_ops,bench_cuda}: a
#                 CUDA build folder copied from the build machine), first, while the local build
#                 runs (results come sooner when they run on the host)
#   BUILD=0       skip the local build (only with PREBUILT)
#   BENCH=0|quick|full (default full)   GTEST_FILTER as usual
#   SANITIZE=filter   also run those tests under compute-sanitizer memcheck
#   TORCH=1           also time PyTorch SDPA (cuDNN, FlashAttention-2) on the same shape
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-$root/out}"
mkdir -p "$out"
build_dir="${BUILD_DIR:-$root/build-gpu}"
summary=()

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  nvcc --version | tail -2
  for h in pcre2.h utf8proc.h CLI/CLI.hpp yaml-cpp/yaml.h nlohmann/json.hpp fmt/format.h gtest/gtest.h cudnn.h \
           x86_64-linux-gnu/cudnn.h nccl.h; do
    [[ -e /usr/include/$h ]] && echo "header $h: yes" || echo "header $h: NO"
  done
  pkg-config --list-all 2>/dev/null | grep -i -E 'openblas|pcre2|utf8proc|yaml|fmt|gtest' || true
} > "$out/host.txt" 2>&1

build_pid=""
if [[ "${BUILD:-1}" != 0 ]]; then
  ( time "$root/scripts/gpu/build.sh" spindle_backend_cuda test_cuda_ops bench_cuda ) > "$out/build.log" 2>&1 &
  build_pid=$!
fi

# run_tests <binary> <tag>: gtest with a time limit; records "tag: N passed, M failed [names]".
run_tests() {
  local bin="$1" tag="$2" log="$out/test_$2.log"
  timeout 200 "$bin" --gtest_color=no ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} > "$log" 2>&1
  local rc=$?
  local passed failed
  passed=$(grep -c '^\[       OK \]' "$log")
  failed=$(grep '^\[  FAILED  \]' "$log" | grep -v 'listed below' | sed 's/^\[  FAILED  \] //; s/ (.*//' | sort -u | tr '\n' ' ')
  summary+=("tests ($tag): rc=$rc, $passed passed${failed:+, FAILED: $failed}")
}

run_sanitizer() {
  local bin="$1"
  [[ -z "${SANITIZE:-}" ]] && return
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "$bin" --gtest_color=no --gtest_filter="$SANITIZE" \
    > "$out/sanitize.log" 2>&1
  summary+=("memcheck ($SANITIZE): rc=$? $(grep -E 'ERROR SUMMARY' "$out/sanitize.log" | tail -1)")
}

run_bench() {
  local bin="$1" tag="$2"
  [[ "${BENCH:-full}" == 0 ]] && return
  local arg=""
  [[ "${BENCH:-full}" == quick ]] && arg=--quick
  timeout 150 "$bin" $arg > "$out/bench_$tag.log" 2>&1
  summary+=("bench ($tag): rc=$?")
}

if [[ -n "${PREBUILT:-}" && -x "$PREBUILT/tests/cuda/test_cuda_ops" ]]; then
  if "$PREBUILT/tests/cuda/test_cuda_ops" --gtest_list_tests > "$out/prebuilt_list.log" 2>&1; then
    run_tests "$PREBUILT/tests/cuda/test_cuda_ops" prebuilt
    run_bench "$PREBUILT/tests/cuda/bench_cuda" prebuilt
    run_sanitizer "$PREBUILT/tests/cuda/test_cuda_ops"
  else
    summary+=("prebuilt binaries do not run here (see prebuilt_list.log)")
  fi
fi

if [[ -n "$build_pid" ]]; then
  wait "$build_pid"
  brc=$?
  summary+=("build: rc=$brc ($(grep real "$out/build.log" | tail -1))")
  if [[ $brc == 0 ]]; then
    [[ -f "$build_dir/deps_env.sh" ]] && source "$build_dir/deps_env.sh"
    # Skip the local run when the prebuilt one already ran (same sources), unless asked.
    if [[ -z "${PREBUILT:-}" || "${RUN_LOCAL:-0}" == 1 ]]; then
      run_tests "$build_dir/tests/cuda/test_cuda_ops" local
      run_bench "$build_dir/tests/cuda/bench_cuda" local
      run_sanitizer "$build_dir/tests/cuda/test_cuda_ops"
    fi
  else
    tail -30 "$out/build.log"
  fi
fi

if [[ "${TORCH:-0}" == 1 ]]; then
  PYTHONUNBUFFERED=1 timeout 120 python3 "$root/scripts/gpu/bench_torch_attention.py" > "$out/bench_torch.log" 2>&1
  summary+=("torch sdpa: rc=$?")
fi

echo "==== summary ===="
cat "$out/host.txt" | head -4
for s in "${summary[@]}"; do echo "$s"; done
for f in "$out"/test_*.log; do
  [[ -f "$f" ]] && grep -A5 -E 'Failure$' "$f" | head -80
done
for f in "$out"/bench_*.log; do
  [[ -f "$f" ]] || continue
  echo "-- $(basename "$f")"
  if [[ "$f" == *torch* ]]; then cat "$f"; else sed -n '/^kernel/,$p' "$f"; grep -i -E 'error|device:' "$f"; fi
done
