#!/usr/bin/env bash
# Runs on the GPU host (one H200-class GPU, ≥ 139 GiB for the 72B rows), from the repository root,
# with the bundle of scripts/gpu/stage.sh (BUNDLE_DIR, default build-bundle;
# STAGE_TARGETS="spindle test_cuda_ops" is enough): the QLoRA rows of docs/perf.md.
#   1. test_cuda_ops --gtest_filter='CudaQuant4*': the CUDA 4-bit dequantisation, bit for bit
#      against the CPU's (which is bitsandbytes', tests/quant).
#   2. spindle bench, Qwen2.5-72B architecture (configs/qwen2.5-72b.json), NF4 base weights
#      quantised as they are drawn (the dense 145 GB model never exists on the GPU), LoRA r16 on
#      all 7 projections, --recompute all: the lengths of Q72_SEQ in one process (the first one is
#      a warm-up row; a sweep stops at the first length that does not fit), then keep-attention
#      at Q72_KEEP_SEQ.
#   3. the same for Qwen2.5-7B (configs/qwen2.5-7b.json) at Q7_SEQ.
# Writes ${OUT:-out}/qlora_test.log, qlora_<name>.json (bench --json-file, rewritten after every
# length) and qlora_<name>.log, and prints a summary last.
#   PARTS="test 72b 72b-keep 7b" (default: all)   QUANT="nf4" (add e.g. "--double-quant" in QUANT_FLAGS)
#   Q72_SEQ=2k,8k,32k,48k,56k  Q72_KEEP_SEQ=2k,8k,16k  Q7_SEQ=2k,32k,64k,128k,192k  STEPS=1 WARMUP=0
#   (a 72B step at 32k takes tens of seconds; the first, short length of each sweep pays the
#   one-time costs and is not a result)
#   LIMIT_72B=seconds, LIMIT_7B=seconds: per bench process (default 560 each; a process cut short
#   keeps its finished lengths in its JSON file)
set -uo pipefail
root=$PWD
stage=${BUNDLE_DIR:-$root/build-bundle}
out=${OUT:-$root/out}; mkdir -p "$out"
for f in "$stage"/lib/*; do n=$(basename "$f"); ldconfig -p | grep -q "^[[:space:]]*$n " && rm -f "$f"; done
export LD_LIBRARY_PATH="$stage/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for mod in nccl cudnn; do  # PyTorch's wheels when the system has none
  lib=$([[ $mod == nccl ]] && echo libnccl.so.2 || echo libcudnn.so.9)
  if ! ldconfig -p | grep -q "$lib"; then
    d="$(python3 -c "import nvidia.$mod, os; print(os.path.join(list(nvidia.$mod.__path__)[0], 'lib'))" 2>/dev/null)"
    [[ -d "$d" ]] && export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
  fi
done
parts=${PARTS:-test 72b 72b-keep 7b}
has() { [[ " $parts " == *" $1 "* ]]; }
S=$stage/bin/spindle
summary=()
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/qlora_host.txt" 2>&1

if has test; then
  timeout 120 "$stage/bin/test_cuda_ops" --gtest_color=no --gtest_filter='CudaQuant4*' > "$out/qlora_test.log" 2>&1
  summary+=("CudaQuant4 rc=$? ($(grep -E '^\[  (PASSED|FAILED)' "$out/qlora_test.log" | tr '\n' ' '))")
fi

# bench NAME CONFIG SEQS RECOMPUTE LIMIT
bench() {
  local name=$1 model=$2 seqs=$3 recompute=$4 limit=$5
  local start=$SECONDS
  timeout "$limit" "$S" bench --device cuda --model "$root/configs/$model" --seq "$seqs" \
    --quantize "${QUANT:-nf4}" ${QUANT_FLAGS:-} --lora-rank 16 --recompute "$recompute" \
    --steps "${STEPS:-1}" --warmup "${WARMUP:-0}" --profile-steps 0 \
    --json-file "$out/qlora_$name.json" 2>&1 |
    while IFS= read -r line; do printf '%4d s  %s\n' $((SECONDS - start)) "$line"; done > "$out/qlora_$name.log"
  local rc=${PIPESTATUS[0]}  # the seconds on each line show when each length finished (the first: after the init)
  summary+=("$name ($model, $recompute, $seqs): rc=$rc in $((SECONDS - start)) s")
  tail -n 12 "$out/qlora_$name.log"
}
has 72b && bench 72b_all qwen2.5-72b.json "${Q72_SEQ:-2k,8k,32k,48k,56k}" all "${LIMIT_72B:-560}"
has 72b-keep && bench 72b_keep qwen2.5-72b.json "${Q72_KEEP_SEQ:-2k,8k,16k}" keep-attention "${LIMIT_72B:-560}"
has 7b && bench 7b_all qwen2.5-7b.json "${Q7_SEQ:-2k,32k,64k,128k,192k}" all "${LIMIT_7B:-560}"

# One line per length: tokens/s, peak allocated GiB, MFU (from the JSON files).
python3 - "$out" <<'EOF' || true
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "qlora_*.json"))):
    r = json.load(open(f))
    for x in r.get("results", []):
        if x.get("error"):
            print(f"{os.path.basename(f)} seq {x['seq']}: {x['error'][:100]}")
        else:
            print(f"{os.path.basename(f)} seq {x['seq']}: {x['tokens_per_s']:.0f} tok/s, "
                  f"peak {x['peak_allocated_bytes'] / 2**30:.1f} GiB, MFU {100 * x['mfu']:.1f}%, "
                  f"step {x['step_ms'][0] / 1000:.1f} s")
EOF
printf '%s\n' "${summary[@]}"
