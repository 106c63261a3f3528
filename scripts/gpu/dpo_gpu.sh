#!/usr/bin/env bash
# Runs on the GPU host (2 GPUs), from the repository root, with the bundle of scripts/gpu/stage.sh
# (BUNDLE_DIR, default build-bundle):
# `spindle dpo` on 1 GPU and on 2 GPUs at sp 2 (Ulysses, ring), same global batch; prints the
# losses and margins of every step and the largest relative loss difference to 1 GPU.
set -uo pipefail
root=$PWD
stage=${BUNDLE_DIR:-$root/build-bundle}
for f in "$stage"/lib/*; do n=$(basename "$f"); ldconfig -p | grep -q "^[[:space:]]*$n " && rm -f "$f"; done
export LD_LIBRARY_PATH="$stage/lib:/usr/lib/x86_64-linux-gnu/openblas-pthread${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
S=$stage/bin/spindle
work=$(mktemp -d)
python3 demo/make_model.py "$work/model" > /dev/null
python3 - "$work/pairs.jsonl" <<'PY'
import json, random, sys
rng = random.Random(0)
facts = [(json.loads(l)["messages"][0]["content"], json.loads(l)["messages"][1]["content"])
         for l in open("demo/capitals.jsonl")]
with open(sys.argv[1], "w") as f:
    for q, a in facts:
        wrong = rng.choice([b for _, b in facts if b != a])
        f.write(json.dumps({"prompt": [{"role": "user", "content": q}], "chosen": a, "rejected": wrong}) + "\n")
PY
common=(dpo --device cuda --model "$work/model" --data "$work/pairs.jsonl" --max-length 256 --lora-rank 8 --beta 0.1
        --lr 1e-3 --lr-scheduler constant --grad-accum 4 --max-steps 8 --log-every 100)
timeout 120 "$S" "${common[@]}" --output "$work/one" > "$work/one.log" 2>&1 || tail -n 5 "$work/one.log"
timeout 120 "$S" "${common[@]}" --output "$work/ulysses" --nproc-per-node 2 --sp 2 > "$work/u.log" 2>&1 || tail -n 5 "$work/u.log"
timeout 120 "$S" "${common[@]}" --output "$work/ring" --nproc-per-node 2 --sp 2 --ring 2 > "$work/r.log" 2>&1 || tail -n 5 "$work/r.log"
python3 - "$work" <<'PY'
import json, os, sys
w = sys.argv[1]
runs = {n: [json.loads(l) for l in open(os.path.join(w, n, "metrics.jsonl"))] for n in ("one", "ulysses", "ring")
        if os.path.exists(os.path.join(w, n, "metrics.jsonl"))}
for n, m in runs.items():
    print(f"{n:8s} loss", [round(x["loss"], 6) for x in m])
    print(f"{n:8s} margins", [round(x["rewards/margins"], 5) for x in m])
for n in ("ulysses", "ring"):
    if n in runs and "one" in runs:
        rel = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(runs[n], runs["one"]))
        print(f"{n}: largest relative loss difference to 1 GPU over {len(runs[n])} steps: {rel:.2e}")
PY
