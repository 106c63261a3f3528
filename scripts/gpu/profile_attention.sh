#!/usr/bin/env bash
# Runs on the GPU host: Nsight Compute on the default attention kernels (forward, wide backward) at
# 8k causal, Hq=12, Hkv=2, D=128, via bench_cuda --profile. Clocks are left as the card has them
# (--clock-control none). Writes $OUT/ncu_<kernel>.txt and prints the headline numbers.
#   BENCH_BIN=path (default build-gpu/tests/cuda/bench_cuda)
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-$root/out}"
mkdir -p "$out"
bin="${BENCH_BIN:-$root/build-gpu/tests/cuda/bench_cuda}"
ncu_bin="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
[[ -x "$ncu_bin" ]] || { echo "profile_attention: ncu not found"; exit 1; }
for kernel in forward_kernel backward_wide_kernel; do
  # --launch-skip 1: profile the timed launch, not the warm-up.
  timeout 150 "$ncu_bin" --clock-control none -k "regex:$kernel" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section Occupancy \
    --section LaunchStats --section SchedulerStats --section InstructionStats --print-details all \
    "$bin" --profile > "$out/ncu_$kernel.txt" 2>&1
  echo "== $kernel: rc=$?"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|No Eligible|Stall|Bank|Executed Ipc|Pipe|Shared Memory|Warp Cycles Per Issued|One or More" \
    "$out/ncu_$kernel.txt" | head -40
done
