#!/usr/bin/env bash
# Runs on the GPU host (Nsight Compute's ncu installed): ncu on the default attention kernels at
# 32k causal, Hq=12, Hkv=2, D=128, via bench_cuda --profile. Clocks are left as the card has them
# (--clock-control none). Writes ${OUT:-out}/ncu_<kernel>.txt (sections) and
# ncu_<kernel>_sass.csv.gz (per-instruction stall samples) and prints the headline numbers.
#   BENCH_BIN=path    default build-bundle/bin/bench_cuda (scripts/gpu/stage.sh with bench_cuda in
#                     STAGE_TARGETS), or build-gpu/tests/cuda/bench_cuda after scripts/gpu/build.sh
#   KERNELS="regex ..."  default: the wgmma kernels
#   BENCH_ARGS=--profile-packed: the same kernels on a 32k row of 32 documents of 1k
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-$root/out}"
mkdir -p "$out"
bin="${BENCH_BIN:-$root/build-bundle/bin/bench_cuda}"
ncu_bin="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)"
[[ -x "$ncu_bin" ]] || { echo "profile_attention: ncu not found"; exit 1; }
for kernel in ${KERNELS:-backward_wgmma_kernel forward_wgmma_kernel}; do
  # --launch-skip 1: profile the timed launch, not the warm-up.
  timeout 200 "$ncu_bin" --clock-control none -k "regex:$kernel" --launch-skip 1 --launch-count 1 \
    --set full --import-source no -o "$out/ncu_$kernel" -f "$bin" ${BENCH_ARGS:---profile} > "$out/ncu_${kernel}_run.txt" 2>&1
  echo "== $kernel: rc=$?"
  "$ncu_bin" -i "$out/ncu_$kernel.ncu-rep" --print-details all > "$out/ncu_$kernel.txt" 2>&1
  "$ncu_bin" -i "$out/ncu_$kernel.ncu-rep" --page source --print-source sass --csv > "$out/ncu_${kernel}_sass.csv" 2>&1
  gzip -f "$out/ncu_${kernel}_sass.csv"
  rm -f "$out/ncu_$kernel.ncu-rep"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Issue Slots Busy|No Eligible|Bank|Executed Ipc|Shared Memory|Warp Cycles Per Issued|One or More|Stall|Tensor|L2 Hit|DRAM Throughput|L1/TEX Hit" \
    "$out/ncu_$kernel.txt" | head -50
done
