#!/usr/bin/env bash
# Runs on the GPU host, from the repository root, with the bundle of scripts/gpu/stage.sh
# (STAGE_TARGETS=spindle is enough; BUNDLE_DIR, default build-bundle). What the recompute settings
# keep must not change a step on the device either: `spindle sft` for 4 optimizer steps on the tiny
# test models (qwen2; qwen3_5_moe: gated DeltaNet, gated attention, experts), LoRA and full, with
# --recompute all as it is and with sparse checkpoints (--checkpoint-stride 2, 3: regenerated layer
# inputs), activation offload, and both. Each step's grad norm and the losses after the first step
# depend on every gradient, so equal numbers mean bit-identical steps. `spindle bench` cannot show
# this: it runs no optimizer step, so its loss is the forward's.
# DEVICE=cpu runs the same on the CPU backend. Prints one EQUAL / DIFFERENT line per comparison.
set -uo pipefail
stage=${BUNDLE_DIR:-$PWD/build-bundle}
export LD_LIBRARY_PATH="$stage/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
S=${SPINDLE:-$stage/bin/spindle}
device=${DEVICE:-cuda}
w=$(mktemp -d)
status=0
for m in qwen2 qwen3_5_moe; do
  for mode in lora full; do
    for variant in plain stride2 stride3 offload stride2_offload; do
      extra=(--lora-rank 4); [[ $mode == full ]] && extra=(--full)
      [[ $variant == *stride2* ]] && extra+=(--checkpoint-stride 2)
      [[ $variant == *stride3* ]] && extra+=(--checkpoint-stride 3)
      [[ $variant == *offload* ]] && extra+=(--offload activations)
      "$S" sft --model "testdata/hf/$m" --data "testdata/hf/$m/data.jsonl" --output "$w/$m-$mode-$variant" \
        --max-steps 4 --lr 0.01 --max-length 32 --device "$device" --recompute all --seed 7 "${extra[@]}" \
        > "$w/$m-$mode-$variant.log" 2>&1 || { echo "$m $mode $variant failed:"; tail -3 "$w/$m-$mode-$variant.log"; status=1; }
    done
    python3 - "$w" "$m" "$mode" <<'PY' || status=1
import json, os, sys
w, m, mode = sys.argv[1:4]
def read(variant):
    p = os.path.join(w, f"{m}-{mode}-{variant}", "metrics.jsonl")
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, open(p))] if os.path.exists(p) else None
base, ok = read("plain"), True
for variant in ("stride2", "stride3", "offload", "stride2_offload"):
    got = read(variant)
    same = got is not None and got == base
    ok &= same
    print(f"{m} {mode} {variant}: {'EQUAL' if same else 'DIFFERENT'} (loss, grad norm) per step {got} "
          f"{'' if same else f'vs recompute all {base}'}")
sys.exit(0 if ok else 1)
PY
  done
done
rm -rf "$w"
exit $status
