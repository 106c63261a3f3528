#!/usr/bin/env bash
# Runs on the GPU host, from the repository root, with the bundle of scripts/gpu/stage.sh
# (BUNDLE_DIR, default build-bundle): what `--recompute auto` chooses on one H200 and what it
# measures, beside the plan (docs/memory.md). Each line is one `spindle bench` run (under 10 minutes):
#   PART=auto   1.5B and 7B at 32k and 64k, the whole GPU as budget, then both at the peer's memory
#               (HF + Liger + gradient checkpointing: 1.5B 11.0 / 18.8 GiB, 7B 32.3 / 49.8 GiB at 32k / 64k; --device-memory is
#               that plus auto's CUDA margin, 2 GiB + 3 %, so the planned peak stays under it)
#   PART=offload the 1.5B at 512k with activation offload (plan 69.61 GiB on the GPU, 40.50 GiB pinned;
#               measured 70.16 and 40.50 at 522fdb1)
#   PART=moe_longest Qwen3.6-35B-A3B at 360k (the plan's longest with auto is 373,639: all, 37 of 40 layers
#               offloaded, 132.68 GiB planned), one step (~3 minutes)
#   PART=stride sparse checkpoints (--checkpoint-stride): the 1.5B at 32k, recompute all, strides 1, 2 and 3
#               (losses must be equal bit for bit; the time a regenerating forward adds), then the 7B at
#               128k with offload and 16k MLP tiles, strides 1 and 2 (~3 minutes); each beside its plan
#   PART=exact  the 1.5B at 32k, keep-attention and all, with and without offload: the losses must be
#               equal bit for bit (the copies are exact; the CUDA side of offload has not run before)
# Writes ${OUT:-out}/recompute_auto_<part>_<model>_<seq>.{json,txt}; the JSON has the setting chosen
# (results[].recompute, recompute_layers, offload), peak_allocated_bytes and offload_host_bytes.
set -uo pipefail
root=$PWD
stage=${BUNDLE_DIR:-$root/build-bundle}
out=${OUT:-$root/out}; mkdir -p "$out"
export LD_LIBRARY_PATH="$stage/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
S="$stage/bin/spindle"
one() {  # tag model seq extra...
  local tag=$1 model=$2 seq=$3; shift 3
  local config="$root/configs/qwen2.5-$model.json"
  [[ -f "$config" ]] || config="$root/configs/$model.json"
  timeout ${TIMEOUT:-590} "$S" bench --device cuda --model "$config" --seq "$seq" \
    --lora-rank 16 --warmup "${WARMUP:-1}" --steps "${STEPS:-2}" --profile-steps 0 --json-file "$out/recompute_auto_${tag}_${model}_${seq}.json" \
    "$@" 2>&1 | tee "$out/recompute_auto_${tag}_${model}_${seq}.txt" | tail -4
}
case ${PART:-auto} in
  auto)
    for m in 1.5b 7b; do for s in 32k 64k; do one auto "$m" "$s" --recompute auto; done; done
    one peer 1.5b 32k --recompute auto --device-memory 13.4GiB   # 11.0 GiB + the margin
    one peer 1.5b 64k --recompute auto --device-memory 21.5GiB    # 18.8 GiB + the margin
    one peer 7b 32k --recompute auto --device-memory 35.4GiB      # 32.3 GiB + the margin
    one peer 7b 64k --recompute auto --device-memory 53.4GiB ;;   # 49.8 GiB + the margin
  offload)
    WARMUP=0 STEPS=1 one offload 1.5b 512k --recompute all --offload activations ;;
  stride)
    for st in 1 2 3; do one "stride$st" 1.5b 32k --recompute all --checkpoint-stride "$st"; done
    for st in 1 2; do
      WARMUP=0 STEPS=1 one "stride$st" 7b 128k --recompute all --offload activations --mlp-tile-tokens 16k --checkpoint-stride "$st"
    done
    for run in stride1_1.5b_32k:qwen2.5-1.5b:32k:"" stride2_1.5b_32k:qwen2.5-1.5b:32k:"" stride3_1.5b_32k:qwen2.5-1.5b:32k:"" \
               stride1_7b_128k:qwen2.5-7b:128k:off stride2_7b_128k:qwen2.5-7b:128k:off; do
      IFS=: read -r tag model seq off <<<"$run"
      st=${tag%%_*}; st=${st#stride}
      "$S" plan --device cuda --bench-step --json --model "$root/configs/$model.json" --seq "$seq" --lora-rank 16 \
        --recompute all --checkpoint-stride "$st" ${off:+--offload activations --mlp-tile-tokens 16k} \
        > "$out/recompute_auto_${tag}_plan.json"
    done
    python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
for group in (("stride1_1.5b_32k", "stride2_1.5b_32k", "stride3_1.5b_32k"), ("stride1_7b_128k", "stride2_7b_128k")):
    base = None
    for tag in group:
        try:
            r = json.load(open(os.path.join(out, f"recompute_auto_{tag}.json")))["results"][0]
            plan = json.load(open(os.path.join(out, f"recompute_auto_{tag}_plan.json")))["results"][0]["peak_allocated_bytes"]
        except (OSError, KeyError, IndexError, ValueError) as e:
            print(f"{tag}: no result ({e})"); continue
        base = base or r
        print(f"{tag}: {r['tokens_per_s']:.0f} tok/s ({100 * (r['tokens_per_s'] / base['tokens_per_s'] - 1):+.1f} %), "
              f"peak {r['peak_allocated_bytes'] / 2**30:.2f} GiB (plan {plan / 2**30:.2f}), host "
              f"{r['offload_host_bytes'] / 2**30:.2f} GiB, loss {r['loss']!r} "
              f"({'equal' if r['loss'] == base['loss'] else 'DIFFERENT'})")
PY
    ;;
  moe_longest)
    WARMUP=0 STEPS=1 one longest qwen3.6-35b-a3b 360k --recompute auto ;;
  exact)
    for r in keep-attention all; do
      one "exact_${r}_none" 1.5b 32k --recompute "$r"
      one "exact_${r}_offload" 1.5b 32k --recompute "$r" --offload activations
      python3 - "$out/recompute_auto_exact_${r}_none_1.5b_32k.json" "$out/recompute_auto_exact_${r}_offload_1.5b_32k.json" <<'PY'
import json, sys
a, b = (json.load(open(p))["results"][0] for p in sys.argv[1:3])
print(f"{a['recompute']}: loss {a['loss']!r} without offload, {b['loss']!r} with "
      f"({'equal' if a['loss'] == b['loss'] else 'DIFFERENT'}); peak {a['peak_allocated_bytes'] / 2**30:.2f} -> "
      f"{b['peak_allocated_bytes'] / 2**30:.2f} GiB, host {b['offload_host_bytes'] / 2**30:.2f} GiB; "
      f"{a['tokens_per_s']:.0f} -> {b['tokens_per_s']:.0f} tokens/s")
PY
    done ;;
esac
