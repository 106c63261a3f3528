#!/usr/bin/env bash
# Runs on the GPU host, from the repository root, with the bundle of scripts/gpu/stage.sh
# (STAGE_TARGETS=spindle is enough; BUNDLE_DIR, default build-bundle). Sparse checkpoints on the
# device: `spindle sft` for 4 optimizer steps on the tiny test models (qwen2; qwen3_5_moe: gated
# DeltaNet, gated attention, experts), LoRA and full, with --checkpoint-stride 1, 2 and 3. Each
# step's grad norm and the losses after the first step depend on every gradient, so equal numbers
# mean the regenerated layer inputs were bit-identical to the kept ones (deterministic forward
# kernels). `spindle bench` cannot show this: it runs no optimizer step, so its loss is the forward's.
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
    for st in 1 2 3; do
      extra=(--lora-rank 4); [[ $mode == full ]] && extra=(--full)
      "$S" sft --model "testdata/hf/$m" --data "testdata/hf/$m/data.jsonl" --output "$w/$m-$mode-$st" --max-steps 4 \
        --lr 0.01 --max-length 32 --device "$device" --recompute all --checkpoint-stride "$st" --seed 7 "${extra[@]}" \
        > "$w/$m-$mode-$st.log" 2>&1 || { echo "$m $mode stride $st failed:"; tail -3 "$w/$m-$mode-$st.log"; status=1; }
    done
    python3 - "$w" "$m" "$mode" <<'PY' || status=1
import json, os, sys
w, m, mode = sys.argv[1:4]
def read(st):
    p = os.path.join(w, f"{m}-{mode}-{st}", "metrics.jsonl")
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, open(p))] if os.path.exists(p) else None
base, ok = read(1), True
for st in (2, 3):
    got = read(st)
    same = got is not None and got == base
    ok &= same
    print(f"{m} {mode} stride {st}: {'EQUAL' if same else 'DIFFERENT'} (loss, grad norm) per step {got} "
          f"{'' if same else f'vs stride 1 {base}'}")
sys.exit(0 if ok else 1)
PY
  done
done
rm -rf "$w"
exit $status
