#!/usr/bin/env bash
# Runs on the GPU host (one GPU), from the repository root, with the bundle of scripts/gpu/stage.sh
# (BUNDLE_DIR, default build-bundle; STAGE_TARGETS="spindle" is enough): how fast each recompute
# setting runs on this GPU, and what `--recompute auto` chooses there (docs/perf.md, "--recompute
# auto on the H100 and the H200").
#   PART=profile  Qwen2.5-1.5B at 32k with recompute none (first, as a fresh process on the GPU),
#                 keep-attention and none again (with PROFILE_MORE=1 also all, and Qwen2.5-7B at 16k
#                 with none and keep-attention); each with one profiled step and its whole op table
#                 (--op-table, JSON), the GPU's clocks and power sampled meanwhile (~1 minute);
#                 ISSUE_RUNS=1 adds issue #40's auto, keep-attention, none and 11 GiB auto runs
#                 (`--warmup 1 --steps 2`) after them
#   ISSUE_FIRST=1 (any part) first runs issue #40's `--recompute auto --warmup 1 --steps 2` of the
#                 1.5B at 32k, as the machine's first process
#   PART=table    the 1.5B and the 7B at 16k, 32k and 64k (MODELS, SEQS): --recompute auto and, for
#                 each length, none, keep-attention on the first N layers (the fewest that fit, where
#                 none does not), keep-attention and all, each where its plan fits the GPU with
#                 auto's margin; one bench process per row and setting (~7 minutes on an H100)
#   PART="profile table" runs both, in that order.
# Writes ${OUT:-out}/rank_<part>.tgz (every run's .json and .txt, smi.csv) and rank_<part>_summary.txt,
# which it also prints.
set -uo pipefail
root=$PWD
stage=${BUNDLE_DIR:-$root/build-bundle}
out=${OUT:-$root/out}; mkdir -p "$out"
work=$(mktemp -d)
for f in "$stage"/lib/*; do n=$(basename "$f"); ldconfig -p | grep -q "^[[:space:]]*$n " && rm -f "$f"; done
export LD_LIBRARY_PATH="$stage/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
for mod in nccl cudnn; do  # PyTorch's wheels when the system has none
  lib=$([[ $mod == nccl ]] && echo libnccl.so.2 || echo libcudnn.so.9)
  if ! ldconfig -p | grep -q "$lib"; then
    d="$(python3 -c "import nvidia.$mod, os; print(os.path.join(list(nvidia.$mod.__path__)[0], 'lib'))" 2>/dev/null)"
    [[ -d "$d" ]] && export LD_LIBRARY_PATH="$d:$LD_LIBRARY_PATH"
  fi
done
S=$stage/bin/spindle
part=${PART:-table}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv > "$work/gpu.txt" 2>&1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 500 > "$work/smi.csv" 2>&1 &
smi=$!
summary=$work/summary.txt
cat "$work/gpu.txt" > "$summary"

# run TAG MODEL SEQS ARGS...: one bench process; its JSON is rewritten after every length.
run() {
  local tag=$1 model=$2 seqs=$3; shift 3
  local start=$SECONDS
  timeout "${LIMIT:-300}" "$S" bench --device cuda --model "$root/configs/qwen2.5-$model.json" --seq "$seqs" \
    --lora-rank 16 --json-file "$work/$tag.json" "$@" > "$work/$tag.txt" 2>&1
  echo "$tag: rc=$? in $((SECONDS - start)) s" >> "$summary"
}

if [[ -n ${ISSUE_FIRST:-} ]]; then  # issue #40's auto run as the fresh machine's first process
  run i_auto_first 1.5b 32k --recompute auto --warmup 1 --steps 2 --profile-steps 0
fi
case " $part " in
  *" profile "*)
    "$S" plan --device cuda --bench-step --model "$root/configs/qwen2.5-1.5b.json" --seq 32k --recompute none \
      > "$work/plan_none.txt" 2>&1
    grep "predicted step" "$work/plan_none.txt" >> "$summary"
    prof=(--warmup 2 --steps 2 --profile-steps 1 --op-table 400)
    run p_none_first 1.5b 32k --recompute none "${prof[@]}"
    run p_ka 1.5b 32k --recompute keep-attention "${prof[@]}"
    run p_none_again 1.5b 32k --recompute none "${prof[@]}"
    if [[ -n ${ISSUE_RUNS:-} ]]; then
      # Issue #40's commands as it ran them (one warm-up step, two timed), after the profiled ones.
      issue=(--warmup 1 --steps 2 --profile-steps 0)
      run i_auto 1.5b 32k --recompute auto "${issue[@]}"
      run i_ka 1.5b 32k --recompute keep-attention "${issue[@]}"
      run i_none 1.5b 32k --recompute none "${issue[@]}"
      run i_auto_11g 1.5b 32k --recompute auto --device-memory 11GiB "${issue[@]}"
    fi
    if [[ -n ${PROFILE_MORE:-} ]]; then
      run p_all 1.5b 32k --recompute all "${prof[@]}"
      run p_7b_none 7b 16k --recompute none "${prof[@]}"
      run p_7b_ka 7b 16k --recompute keep-attention "${prof[@]}"
    fi ;;&
  *" table "*)
    # The settings of each row that fit this GPU as auto's margin counts them (2 GiB + 3 % of the
    # device, docs/memory.md), from `spindle plan` here: one line per bench run (tag, seq, warm-up
    # steps, args). keep-attention on N layers: the fewest N that fit, where recompute none does not.
    total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    python3 - "$S" "$root" "$total" "${MODELS:-1.5b 7b}" "${SEQS:-16k 32k 64k}" > "$work/runs.txt" <<'PY'
import json, subprocess, sys
spindle, root, total_mib, models, seqs = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(), sys.argv[5].split()
device = total_mib * 2**20
usable = device - (2 * 2**30 + device * 3 // 100)
def peak(model, seq, *args):
    out = subprocess.run([spindle, "plan", "--device", "cuda", "--bench-step", "--json", "--model",
                          f"{root}/configs/qwen2.5-{model}.json", "--seq", seq, *args],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)["results"][0]["peak_allocated_bytes"]
for model in models:
    for seq in seqs:
        tokens = int(seq[:-1]) * 1024 if seq.endswith("k") else int(seq)
        # cuDNN takes a one-document shape from its 65th call, or at once from 12 heads x 40k tokens
        # of scores (backend/cuda/cuda_backend.cpp): two warm-up steps of 28 layers reach it.
        warmup = 1 if (12 if model == "1.5b" else 28) * tokens**2 >= 12 * 40000**2 else 2
        print(f"t_{model}_{seq}_auto {model} {seq} {warmup} --recompute auto")
        none_fits = peak(model, seq, "--recompute", "none") <= usable
        if none_fits:
            print(f"t_{model}_{seq}_none {model} {seq} {warmup} --recompute none")
        else:
            lo, hi = 0, 28  # keep-attention on hi layers fits (checked below), on lo does not
            if peak(model, seq, "--recompute", "keep-attention") <= usable:
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if peak(model, seq, "--recompute", "keep-attention", "--recompute-layers", str(mid)) <= usable:
                        hi = mid
                    else:
                        lo = mid
                if hi < 28:
                    print(f"t_{model}_{seq}_ka{hi} {model} {seq} {warmup} --recompute keep-attention --recompute-layers {hi}")
        for mode in ("keep-attention", "all"):
            if peak(model, seq, "--recompute", mode) <= usable:
                print(f"t_{model}_{seq}_{mode} {model} {seq} {warmup} --recompute {mode}")
PY
    cat "$work/runs.txt" >> "$summary"
    # DEADLINE (seconds since the start): runs that would start after it are skipped and listed.
    while read -r tag model seq warmup args; do
      if (( SECONDS > ${DEADLINE:-100000} )); then echo "$tag: skipped (DEADLINE)" >> "$summary"; continue; fi
      # shellcheck disable=SC2086
      run "$tag" "$model" "$seq" $args --warmup "$warmup" --steps "${STEPS:-2}" --profile-steps 0
    done < "$work/runs.txt" ;;&
  *) ;;
esac
kill $smi 2>/dev/null
python3 - "$work" >> "$summary" <<'PY'
import glob, json, os, sys
work = sys.argv[1]
rows = []
for path in sorted(glob.glob(os.path.join(work, "*.json"))):
    try:
        rep = json.load(open(path))
    except ValueError:
        continue
    for r in rep.get("results", []):
        tag = os.path.basename(path)[:-5]
        if "error" in r:
            rows.append(f"{tag:28} {r['seq']:>7} error: {r['error'][:90]}")
            continue
        setting = r["recompute"] + (f"/{r['recompute_layers']}" if r["recompute_layers"] >= 0 else "")
        if r["offload"] != "none":
            setting += f" off{r['offload_layers'] if r['offload_layers'] >= 0 else ''}"
        if r["mlp_tile_tokens"]:
            setting += f" tile{r['mlp_tile_tokens']}"
        split = r.get("split_ms", {})
        rows.append(f"{tag:28} {r['seq']:>7} {setting:24} {r['tokens_per_s']:>9.0f} tok/s  mfu {100 * r['mfu']:5.1f}%  "
                    f"exec {r['executed_tflops']:6.1f} TF  peak {r['peak_allocated_bytes'] / 2**30:6.2f}  resv "
                    f"{r['peak_reserved_bytes'] / 2**30:6.2f}  dev {r['device_used_bytes'] / 2**30:6.2f} GiB"
                    + (f"  split a{split.get('attention', 0):.0f} g{split.get('gemm', 0):.0f} o{split.get('other_ops', 0):.0f}"
                       f" i{split.get('idle', 0):.0f} ms" if split else ""))
print("\n".join(rows))
PY
tag=${part// /_}
tar -czf "$out/rank_$tag.tgz" -C "$work" .
cp "$summary" "$out/rank_${tag}_summary.txt"
cat "$summary"
