#!/usr/bin/env bash
# Runs on a GPU host with 4 or 8 GPUs (H200), from the repository root, with the bundle of
# scripts/gpu/stage.sh (default targets; BUNDLE_DIR, default build-bundle): sequence parallelism
# over 4 and 8 GPUs. One part per invocation, each under 10 minutes; each runs gpu_run.sh with the
# part's settings, results in ${OUT:-out}/gpu-out.tgz.
#   PART=check  one SFT step on GPUS ranks against one process (`spindle check`, bf16 and one F32
#               case) on the HF test models, for the sp = GPUS splits their 4 query heads allow:
#               ulysses 2 × ring, ulysses 4 × ring, pure ring (pure Ulysses 8 needs 8 heads).
#   PART=bench  `spindle bench`, LoRA r16, MODEL (1.5b or 7b) at SEQ on the sp = GPUS splits: the
#               default (the largest ulysses the heads allow: 4 for both models, pure Ulysses at
#               sp 4), pure ring, and ulysses 2 × ring; --recompute RECOMPUTE (keep-attention).
#               SEQ: 128k, 64k per GPU (the 2-GPU 128k row's tokens per GPU: scaling efficiency) and
#               512k.
#               MESHES (';'-separated) replaces the three splits: the 7B at 512k takes ≈ 5 minutes
#               per split (3 steps), so one split per invocation there (with BENCHX_TIMEOUT=560).
#   PART=max    one step of the 7B at MAX_SEQ with --recompute all (the longest context).
#   GPUS        4 or 8 (default: the GPUs nvidia-smi lists).
# Cost, scaled from the 2-GPU 7B rows (attention ∝ T²/GPUs, 53 % of a 64k step): 7B at 1M on 4
# H200s ≈ 8 minutes a step, so MAX_SEQ defaults to 1024k on 4 and 1408k on 8; a 3.7M-token step on 8
# would take ≈ 50 minutes a step (raise BENCHX_TIMEOUT to try it).
set -uo pipefail
root=$PWD
gpus=${GPUS:-$(nvidia-smi --list-gpus | wc -l)}
[[ $gpus == 4 || $gpus == 8 ]] || { echo "scaling.sh: GPUS must be 4 or 8 (got $gpus)"; exit 2; }
case ${PART:-} in
  check)
    CHECK_GPUS=$gpus CHECK_MESHES="--sp $gpus --ulysses 2;--sp $gpus --ulysses 4;--sp $gpus --ring $gpus" \
      PARTS=check bash "$root/scripts/gpu/gpu_run.sh" ;;
  bench)
    model=$root/configs/qwen2.5-${MODEL:-1.5b}.json
    [[ -f $model ]] || { echo "scaling.sh: no $model (MODEL is 1.5b or 7b)"; exit 2; }
    seq=${SEQ:-$([[ $gpus == 4 ]] && echo 128k,256k,512k || echo 128k,512k)}
    runs=()
    IFS=";" read -ra meshes <<< "${MESHES:---sp $gpus;--sp $gpus --ring $gpus;--sp $gpus --ulysses 2}"
    for mesh in "${meshes[@]}"; do
      runs+=("--nproc-per-node $gpus $mesh --model $model --seq $seq --recompute ${RECOMPUTE:-keep-attention}")
    done
    BENCH_RUNS=$(IFS=";"; echo "${runs[*]}") BENCHX_STEPS="--warmup 1 --steps 1 --profile-steps 1" \
      BENCHX_TIMEOUT=${BENCHX_TIMEOUT:-190} PARTS=benchx bash "$root/scripts/gpu/gpu_run.sh" ;;
  max)
    seq=${MAX_SEQ:-$([[ $gpus == 4 ]] && echo 1024k || echo 1408k)}
    BENCH_RUNS="--nproc-per-node $gpus --sp $gpus --model $root/configs/qwen2.5-7b.json --seq $seq --recompute all" \
      BENCHX_STEPS="--warmup 0 --steps 1 --profile-steps 0" BENCHX_TIMEOUT=${BENCHX_TIMEOUT:-580} \
      PARTS=benchx bash "$root/scripts/gpu/gpu_run.sh" ;;
  *) echo "scaling.sh: PART=check|bench|max (see the header)"; exit 2 ;;
esac
