#!/usr/bin/env python3
"""`spindle sft` with its default options (LoRA, --recompute auto, --mlp-tile-tokens auto) trains one step of
every family's transformers reference model (testdata/hf) on the CPU and saves a loadable adapter, and a full
fine-tune of each saves the checkpoint's own tensor names: the defaults must suit every family (Gemma's
sandwich norms rule out MLP tiles; phi3 adapts its fused projections)."""
import glob
import json
import os
import subprocess
import sys
import tempfile

from safetensors import safe_open

spindle, root = sys.argv[1], sys.argv[2]
failures = []
work = tempfile.mkdtemp(prefix="spindle-sft-families-")
cases = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "mistral", "gemma2",
         "gemma3_text", "gemma3", "gpt_oss", "glm4_moe", "phi3"]


def tensor_names(folder):
    names = set()
    for f in glob.glob(os.path.join(folder, "model*.safetensors")):
        with safe_open(f, "np") as st:
            names |= set(st.keys())
    return names


for case in cases:
    d = os.path.join(root, "testdata", "hf", case)
    for mode in ("lora", "full"):
        out = os.path.join(work, f"{case}-{mode}")
        cmd = [spindle, "sft", "--model", d, "--data", os.path.join(d, "data.jsonl"), "--max-steps", "1",
               "--max-length", "48", "--output", out, "--device", "cpu"] + (["--full"] if mode == "full" else [])
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            failures.append(f"{case} {mode}: exit {r.returncode}: {r.stderr[-600:]}")
            continue
        if mode == "lora" and not os.path.exists(os.path.join(out, "adapter", "adapter_model.safetensors")):
            failures.append(f"{case} lora: no adapter saved")
        if mode == "full":
            missing = tensor_names(d) - tensor_names(os.path.join(out, "model"))
            extra = tensor_names(os.path.join(out, "model")) - tensor_names(d)
            if missing or extra:
                failures.append(f"{case} full: saved tensors differ from the checkpoint's: missing {sorted(missing)[:3]}, "
                                f"extra {sorted(extra)[:3]}")
        print(f"{case} {mode}: ok" if not failures or not failures[-1].startswith(f"{case} {mode}") else
              f"{case} {mode}: FAILED")

for f in failures:
    print("FAIL:", f)
print("sft on every family:", "all passed" if not failures else f"{len(failures)} failed")
if not failures:
    subprocess.run(["rm", "-rf", work])
sys.exit(1 if failures else 0)
