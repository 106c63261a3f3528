#!/usr/bin/env bash
# Runs on the GPU host (2 GPUs), from the repository root, with the bundle of scripts/gpu/stage.sh
# (BUNDLE_DIR, default build-bundle): the GPU tests and 2-GPU checks of gpu_run.sh, then the
# benchmark rows with --recompute keep-attention — Qwen2.5-1.5B on 1 GPU (32k, 64k, 128k) and
# 2 GPUs (sp 2 Ulysses and ring: 32k, 128k), Qwen2.5-7B on 1 GPU (32k, 64k) and 2 GPUs (sp 2: 32k,
# 64k): the keep-attention table of docs/perf-history.md (2026-11-30). The current table's rows are
# `PARTS=benchx BENCH_RUNS=design scripts/gpu/gpu_run.sh` (docs/perf.md). Everything lands in
# ${OUT:-out} (gpu-out.tgz, bench.tgz); the tables print last.
set -uo pipefail
root=$PWD
bundle=${BUNDLE_DIR:-$root/build-bundle}
PARTS="tests check sft bench" BENCH_RECOMPUTE=keep-attention BENCH_SEQ=32k,128k BENCH_CUDA_ARGS=--quick \
  bash scripts/gpu/gpu_run.sh > /tmp/gpu_run.log 2>&1
grep -v "_ZN" /tmp/gpu_run.log | tail -60
B=$bundle/bin/spindle
b=/tmp/perf; rm -rf $b; mkdir -p $b
OUT=$b/b15 SPINDLE_BIN=$B RECOMPUTE=keep-attention SWEEPS="0:32k,64k:2:1:1 1:128k:1:1:0" LIMIT=150 \
  bash scripts/gpu/bench.sh 2>&1 | grep -A4 "seq   tokens" | head -12
OUT=$b/b7 SPINDLE_BIN=$B MODEL=$root/configs/qwen2.5-7b.json RECOMPUTE=keep-attention \
  SWEEPS="0:32k:2:1:1 1:64k:1:1:0" LIMIT=150 bash scripts/gpu/bench.sh 2>&1 | grep -A4 "seq   tokens" | head -12
export LD_LIBRARY_PATH="$bundle/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! ldconfig -p | grep -q libnccl.so.2; then
  nccl_lib="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)"
  [[ -d "$nccl_lib" ]] && export LD_LIBRARY_PATH="$nccl_lib:$LD_LIBRARY_PATH"
fi
timeout 150 "$B" bench --nproc-per-node 2 --sp 2 --device cuda --model "$root/configs/qwen2.5-7b.json" --seq 32k,64k \
  --lora-rank 16 --recompute keep-attention --warmup 1 --steps 1 --profile-steps 1 > $b/b7_sp2.txt 2>&1
grep -vE '^\[rank 1\]' $b/b7_sp2.txt | tail -12
mkdir -p "${OUT:-$root/out}" && tar czf "${OUT:-$root/out}/bench.tgz" -C $b .
