#!/usr/bin/env python3
"""`spindle eval` on each HF reference case reproduces transformers' loss (relative error < 1e-5 on
the CPU in f32; with SPINDLE_EVAL_DEVICE=cuda, as scripts/gpu/gpu_run.sh runs it, bf16 on the GPU
within 1e-2). A BF16 request without a GPU is an error that names --device."""
import json
import os
import subprocess
import sys

spindle, root = sys.argv[1], sys.argv[2]
device = os.environ.get("SPINDLE_EVAL_DEVICE", "cpu")
tolerance = 1e-5 if device == "cpu" else 1e-2
failures = 0
for case in ["llama", "qwen2", "qwen3", "qwen2_lora", "llama_rslora", "qwen3_5", "qwen3_5_lora", "qwen3_moe",
             "qwen3_moe_lora", "qwen3_5_moe", "qwen3_5_moe_lora", "qwen3_5_moe_text", "qwen3_moe_expert_lora",
             "qwen3_5_moe_expert_lora", "mistral", "mistral_lora", "qwen3_yarn", "llama_yarn", "gemma2", "gemma2_lora",
             "gemma3_text", "gemma3", "gpt_oss", "gpt_oss_lora", "qwen3_next", "qwen3_next_lora", "glm4_moe", "glm4_moe_lora",
             "glm4_moe_expert_lora", "glm4_moe_v4", "phi3", "phi3_lora", "phi3_short", "llama_dynamic"]:
    d = os.path.join(root, "testdata", "hf", case)
    cmd = [spindle, "eval", "--model", d, "--data", os.path.join(d, "data.jsonl"), "--max-length", "48",
           "--device", device]
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
    ok = rel < tolerance and got["num_items"] == want["num_items"]
    failures += not ok
    print(f"{case}: loss {got['loss']:.8f} vs transformers {want['loss']:.8f} (rel {rel:.1e}), "
          f"num_items {got['num_items']} vs {want['num_items']}: {'ok' if ok else 'MISMATCH'}")
if device == "cpu":
    d = os.path.join(root, "testdata", "hf", "qwen2")
    out = subprocess.run([spindle, "eval", "--model", d, "--data", os.path.join(d, "data.jsonl"), "--dtype", "bf16"],
                         capture_output=True, text=True)
    ok = out.returncode != 0 and "--device cuda" in out.stderr
    failures += not ok
    print(f"--dtype bf16 on the CPU: {'refused, naming --device cuda' if ok else 'NOT REFUSED: ' + out.stderr}")
sys.exit(1 if failures else 0)
