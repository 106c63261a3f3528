#!/usr/bin/env bash
# Runs on the GPU host: `spindle bench` sweeps on one or more GPUs, one process each — Qwen2.5-1.5B
# architecture (configs/qwen2.5-1.5b.json, random weights), BF16, LoRA r=16 on all 7 projections,
# recompute on, one sequence per step, every token supervised. Writes ${OUT:-out}/bench_<n>.{json,log}
# and bench_host.txt, and prints the tables last.
#   SPINDLE_BIN=path  a spindle built elsewhere, e.g. build-bundle/bin/spindle (scripts/gpu/stage.sh);
#                     a lib/ folder beside its bin/ folder (the bundle's runtime libraries) is put on
#                     LD_LIBRARY_PATH. Default: build-gpu/src/cli/spindle, built on the host with
#                     scripts/gpu/build.sh spindle when missing.
#   MODEL=config.json (default configs/qwen2.5-1.5b.json)   LORA_RANK=16 (0: --full)
#   RECOMPUTE=all (or none, keep-attention)
#   SWEEPS="GPU:LENGTHS[:STEPS:WARMUP:PROFILE] ..."  one process per entry; entries on different GPUs
#                     run at the same time, entries on one GPU one after another.
#                     Default "0:32k,64k:3:1:1 0:128k:1:1:0".
#   LIMIT=seconds     per process (default 560); a sweep cut short keeps its finished lengths in JSON.
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${OUT:-$root/out}"
mkdir -p "$out"
model="${MODEL:-$root/configs/qwen2.5-1.5b.json}"
bin="${SPINDLE_BIN:-}"
if [[ -z "$bin" ]]; then
  bin="$root/build-gpu/src/cli/spindle"
  [[ -x "$bin" ]] || "$root/scripts/gpu/build.sh" spindle > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
  [[ -f "$root/build-gpu/deps_env.sh" ]] && source "$root/build-gpu/deps_env.sh"
fi
lib="$(cd "$(dirname "$bin")/.." && pwd)/lib"
[[ -d "$lib" ]] && export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# NCCL from PyTorch's wheel when the system has none.
if ! ldconfig -p | grep -q libnccl.so.2; then
  nccl_lib="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)"
  [[ -d "$nccl_lib" ]] && export LD_LIBRARY_PATH="$nccl_lib:$LD_LIBRARY_PATH"
fi
lora=(--lora-rank "${LORA_RANK:-16}")
[[ "${LORA_RANK:-16}" == 0 ]] && lora=(--full)

{
  date -u
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
} > "$out/bench_host.txt" 2>&1

# One GPU's entries run in order; different GPUs in parallel.
declare -A per_gpu
n=0
for entry in ${SWEEPS:-0:32k,64k:3:1:1 0:128k:1:1:0}; do
  IFS=: read -r gpu seqs steps warmup profile <<< "$entry"
  per_gpu[$gpu]+="$n:$seqs:${steps:-3}:${warmup:-1}:${profile:-1} "
  n=$((n + 1))
done
pids=()
for gpu in "${!per_gpu[@]}"; do
  (
    for item in ${per_gpu[$gpu]}; do
      IFS=: read -r i seqs steps warmup profile <<< "$item"
      start=$(date +%s)
      timeout "${LIMIT:-560}" "$bin" bench --model "$model" --seq "$seqs" "${lora[@]}" --recompute "${RECOMPUTE:-all}" \
        --steps "$steps" --warmup "$warmup" --profile-steps "$profile" --device cuda --device-index "$gpu" \
        --json-file "$out/bench_$i.json" > "$out/bench_$i.log" 2>&1
      echo "sweep $i (GPU $gpu, $seqs): rc=$? in $(( $(date +%s) - start )) s" >> "$out/bench_$i.log"
    done
  ) &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done

echo "==== bench ===="
head -3 "$out/bench_host.txt"
for f in "$out"/bench_[0-9]*.log; do
  echo "-- $(basename "$f")"
  cat "$f"
done
