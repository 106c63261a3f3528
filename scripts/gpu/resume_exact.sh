#!/usr/bin/env bash
# Runs on the GPU host, from the repository root, with the bundle of scripts/gpu/stage.sh
# (STAGE_TARGETS=spindle is enough; BUNDLE_DIR, default build-bundle). A run resumed from a checkpoint
# must end where the uninterrupted run ends, bit for bit, on the device as on the CPU (where
# tests/train/test_sft.cpp and tests/cli/check_preemption.py check it): `spindle sft` for 40 steps
# on the tiny test models (qwen2; qwen3_5_moe: gated DeltaNet, gated attention, experts), LoRA and
# full, saving every 2 steps; the same run cut after checkpoint-2 (the later checkpoints and the
# export removed) and resumed; and the same run stopped by SIGTERM after its third step (exit 75)
# and resumed. Compared: every step's loss, grad norm and learning rate, and the bytes of the
# trained adapter or model. Cases: packed rows (the engine's own attention kernels), one document
# per row with --attention own, and with two GPUs (when visible) each row split over both (--sp 2).
# One document per row with --attention auto is printed too but not counted: auto gives a row
# shape cuDNN after its 64th attention call in the process, so a resumed process takes the other
# kernels for its first steps (docs/usage.md, "Exact resume").
# DEVICE=cpu runs the same on the CPU backend. Prints one EQUAL / DIFFERENT line per case.
set -uo pipefail
stage=${BUNDLE_DIR:-$PWD/build-bundle}
export LD_LIBRARY_PATH="$stage/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
S=${SPINDLE:-$stage/bin/spindle}
device=${DEVICE:-cuda}
gpus=0
[[ $device == cuda ]] && gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
w=$(mktemp -d)
status=0

compare() {  # compare NAME RESUMED WHOLE MODE COUNTED
  python3 - "$@" <<'PY'
import json, os, struct, sys
name, resumed, whole, mode, counted = sys.argv[1:6]
def tensors(path):  # name -> (dtype, shape, bytes): the file's order of tensors does not matter
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        data = f.read()
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}
def curve(out):
    p = os.path.join(out, "metrics.jsonl")
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in map(json.loads, open(p))] if os.path.exists(p) else None
trained = "model/model.safetensors" if mode == "full" else "adapter/adapter_model.safetensors"
a, b = curve(resumed), curve(whole)
same_curve = a is not None and a == b
same_weights = same_curve and tensors(os.path.join(resumed, trained)) == tensors(os.path.join(whole, trained))
print(f"{name}: {'EQUAL' if same_weights else 'DIFFERENT'} (curve {'equal' if same_curve else 'differs'}"
      f"{'' if not same_curve else ', weights ' + ('equal' if same_weights else 'differ')})"
      f"{'' if counted == '1' else ' [not counted: --attention auto on one-document rows]'}")
if not same_weights and a and b:
    for x, y in zip(a, b):
        if x != y:
            print(f"  first difference at step {y[0]}: resumed {x[1:]}, uninterrupted {y[1:]}")
            break
sys.exit(0 if same_weights or counted != "1" else 1)
PY
}

for m in qwen2 qwen3_5_moe; do
  for mode in lora full; do
    for variant in packed single_own single_auto sp2; do
      [[ $variant == sp2 && ( $device != cuda || $gpus -lt 2 ) ]] && continue
      [[ $variant == single_auto && $device != cuda ]] && continue  # the CPU has one attention
      extra=(--lora-rank 4 --lr 0.01); [[ $mode == full ]] && extra=(--full --lr 0.001)
      [[ $variant == single_* ]] && extra+=(--no-packing)
      [[ $variant == single_own && $device == cuda ]] && extra+=(--attention own)
      [[ $variant == sp2 ]] && extra+=(--nproc-per-node 2 --sp 2)
      counted=1; [[ $variant == single_auto ]] && counted=0
      args=(--model "testdata/hf/$m" --data "testdata/hf/$m/data.jsonl" --max-steps 40 --save-steps 2 --max-length 32
            --lr-scheduler cosine --warmup-steps 2 --device "$device" --seed 7 --log-every 100 "${extra[@]}")
      name="$m $mode $variant"
      whole="$w/$m-$mode-$variant-whole"
      if ! "$S" sft "${args[@]}" --output "$whole" > "$whole.log" 2>&1; then
        echo "$name: the uninterrupted run failed:"; tail -3 "$whole.log"; status=1; continue
      fi
      # Cut after checkpoint-2, as a run killed (SIGKILL, a node failure) after it would be.
      cut="$w/$m-$mode-$variant-cut"
      cp -r "$whole" "$cut"
      find "$cut" -maxdepth 1 -name 'checkpoint-*' ! -name checkpoint-2 -exec rm -rf {} +
      rm -rf "$cut/adapter" "$cut/model"
      if "$S" sft "${args[@]}" --output "$cut" --resume > "$cut.log" 2>&1; then
        compare "$name, resumed from checkpoint-2" "$cut" "$whole" "$mode" "$counted" || status=1
      else
        echo "$name: the resumed run failed:"; tail -3 "$cut.log"; status=1
      fi
      # Stopped by SIGTERM after its third step: a checkpoint there, exit 75, then --resume.
      stopped="$w/$m-$mode-$variant-sigterm"
      "$S" sft "${args[@]}" --output "$stopped" > "$stopped.log" 2>&1 &
      pid=$!
      for _ in $(seq 6000); do
        [[ $(cat "$stopped/metrics.jsonl" 2>/dev/null | wc -l) -ge 3 ]] && break
        kill -0 $pid 2>/dev/null || break
        sleep 0.01
      done
      kill -TERM $pid 2>/dev/null
      wait $pid
      rc=$?
      if [[ $rc == 0 ]]; then
        echo "$name: inconclusive: the run finished before SIGTERM reached it"; continue
      fi
      if [[ $rc != 75 ]]; then
        echo "$name: SIGTERM after step 3 gave exit status $rc, not 75 (stopped, resumable):"; tail -3 "$stopped.log"
        status=1; continue
      fi
      stopped_at=$(wc -l < "$stopped/metrics.jsonl" | tr -d ' ')
      if "$S" sft "${args[@]}" --output "$stopped" --resume > "$stopped.resume.log" 2>&1; then
        compare "$name, stopped by SIGTERM at step $stopped_at then resumed" \
          "$stopped" "$whole" "$mode" "$counted" || status=1
      else
        echo "$name: the run resumed after SIGTERM failed:"; tail -3 "$stopped.resume.log"; status=1
      fi
    done
  done
done
rm -rf "$w"
exit $status
