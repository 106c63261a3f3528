#!/usr/bin/env python3
"""`spindle eval` on each HF reference case reproduces transformers' loss (relative error < 1e-5)."""
import json
import os
import subprocess
import sys

spindle, root = sys.argv[1], sys.argv[2]
failures = 0
for case in ["llama", "qwen2", "qwen3", "qwen2_lora", "llama_rslora"]:
    d = os.path.join(root, "testdata", "hf", case)
    cmd = [spindle, "eval", "--model", d, "--data", os.path.join(d, "data.jsonl"), "--max-length", "48"]
    if os.path.isdir(os.path.join(d, "adapter")):
        cmd += ["--adapter", os.path.join(d, "adapter")]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"{case}: exit {out.returncode}: {out.stderr}")
        failures += 1
        continue
    got = json.loads(out.stdout)
    want = json.load(open(os.path.join(d, "expected.json")))
    rel = abs(got["loss"] - want["loss"]) / abs(want["loss"])
    ok = rel < 1e-5 and got["num_items"] == want["num_items"]
    failures += not ok
    print(f"{case}: loss {got['loss']:.8f} vs transformers {want['loss']:.8f} (rel {rel:.1e}), "
          f"num_items {got['num_items']} vs {want['num_items']}: {'ok' if ok else 'MISMATCH'}")
sys.exit(1 if failures else 0)
