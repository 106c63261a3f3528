#!/usr/bin/env bash
# Runs on the GPU host, from the repository root, with the bundle of scripts/gpu/stage.sh
# (STAGE_TARGETS=spindle is enough; BUNDLE_DIR, default build-bundle): one timed step at the
# maximum-context goals of docs/perf.md (512k on one GPU, 1M on two), Qwen2.5-1.5B LoRA r16,
# --recompute all (keep-attention keeps each layer's attention output too, which does not fit at
# these lengths). Writes ${OUT:-out}/max_context_<gpus>gpu_<seq>.txt.
#   GPUS=1 SEQ=512k (default; ≈ 4 minutes)   GPUS=2 SEQ=1024k MESH="--sp 2" (≈ 8 minutes)
# One invocation per setting (each under 10 minutes; TIMEOUT=seconds, default 590).
set -uo pipefail
root=$PWD
stage=${BUNDLE_DIR:-$root/build-bundle}
out=${OUT:-$root/out}; mkdir -p "$out"
export LD_LIBRARY_PATH="$stage/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! ldconfig -p | grep -q libnccl.so.2; then
  nccl_lib="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)"
  [[ -d "$nccl_lib" ]] && export LD_LIBRARY_PATH="$nccl_lib:$LD_LIBRARY_PATH"
fi
gpus=${GPUS:-1}
launch=()
[[ $gpus -gt 1 ]] && launch=(--nproc-per-node "$gpus")
timeout ${TIMEOUT:-590} "$stage/bin/spindle" bench "${launch[@]}" ${MESH:-} --device cuda --model "$root/configs/qwen2.5-1.5b.json" \
  --seq "${SEQ:-512k}" --lora-rank 16 --recompute all --warmup 0 --steps 1 --profile-steps 0 2>&1 | grep -vE '^\[rank [1-9]' \
  | tee "$out/max_context_${gpus}gpu_${SEQ:-512k}.txt" | tail -8
