#!/usr/bin/env bash
# Runs on the GPU host, from the repository root, with the bundle of scripts/gpu/stage.sh
# (STAGE_TARGETS=spindle is enough; BUNDLE_DIR, default build-bundle): one timed step at the
# maximum-context goals of docs/perf.md (512k on one GPU, 1M on two), Qwen2.5-1.5B LoRA r16,
# --recompute all (keep-attention keeps each layer's attention output too, which does not fit at
# these lengths). Writes ${OUT:-out}/max_context_<gpus>gpu_<seq>.txt.
#   GPUS=1 SEQ=512k (default; ≈ 4 minutes)   GPUS=2 SEQ=1024k MESH="--sp 2" (≈ 8 minutes)
# One invocation per setting (each under 10 minutes; TIMEOUT=seconds, default 590).
# Activation offload (docs/memory.md): MODEL=7b OFFLOAD=activations SEQ=512k runs the Qwen2.5-7B row
#   (recompute all: each layer's 3.5 GiB input in pinned host memory, 95 GiB for 27 layers; keep-attention
#   would double that, more than the host's 128 GiB). `spindle plan`'s prediction for the same run is
#   written first (<tag>_plan.txt) so the measured peak and host bytes sit beside it. The 7B at 512k
#   fits only with its MLP in token tiles: MODEL=7b OFFLOAD=activations MLP_TILE=16k SEQ=512k (planned
#   58.5 GiB on the GPU, 94.5 GiB pinned; the step is ≈ 10 minutes of attention, so TIMEOUT may need raising).
# OFFLOAD_LAYERS=N offloads only the first N layers (--offload-layers; the others stay on the GPU).
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
model="$root/configs/qwen2.5-${MODEL:-1.5b}.json"
tag="max_context_${gpus}gpu_${SEQ:-512k}${MODEL:+_$MODEL}${OFFLOAD:+_offload}${OFFLOAD_LAYERS:+$OFFLOAD_LAYERS}${MLP_TILE:+_tile$MLP_TILE}"
settings=(--recompute "${RECOMPUTE:-all}" --offload "${OFFLOAD:-none}" ${OFFLOAD_LAYERS:+--offload-layers "$OFFLOAD_LAYERS"}
          ${MLP_TILE:+--mlp-tile-tokens "$MLP_TILE"})
"$stage/bin/spindle" plan --world "$gpus" ${MESH:-} --device cuda --model "$model" --seq "${SEQ:-512k}" --lora-rank 16 \
  --bench-step "${settings[@]}" --device-memory 139.8GiB > "$out/${tag}_plan.txt" 2>&1
timeout ${TIMEOUT:-590} "$stage/bin/spindle" bench "${launch[@]}" ${MESH:-} --device cuda --model "$model" \
  --seq "${SEQ:-512k}" --lora-rank 16 "${settings[@]}" --warmup 0 --steps 1 --profile-steps 0 --json-file "$out/${tag}.json" \
  2>&1 | grep -vE '^\[rank [1-9]' | tee "$out/${tag}.txt" | tail -8
