#!/usr/bin/env python3
"""The Python tiny models load in spindle for every family the helper writes: a folder from
tiny_model.write_model (llama; qwen2 with q/k/v biases and a tied head; qwen3 with q/k norms and
head_dim apart from hidden/heads; qwen3_moe with experts and a dense layer; qwen3_5 with gated DeltaNet and
gated attention layers; qwen3_5_moe with experts and a shared expert in every layer; gpt_oss with sinks, a
sliding layer and biased [E, in, out] experts; glm4_moe with a dense layer, the sigmoid router's correction
biases and ungated shared experts; phi3 with fused qkv_proj and gate_up_proj, untied and
tied; one with the demo's
tokenizer) holds every tensor spindle's
loader asks for, with the shapes it expects, and `spindle eval` scores a document on it.

usage: check_tiny_model.py SPINDLE ROOT
"""
import json
import math
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_model import (config, glm4_moe_config, gpt_oss_config, phi3_config, qwen3_5_config, qwen3_5_moe_config,  # noqa: E402
                        qwen3_moe_config, write_model)

spindle, root = sys.argv[1], sys.argv[2]
cases = {
    "llama": (config(), {}),
    "qwen2_tied": (config(model_type="qwen2", tie_word_embeddings=True), {"weight_std": 0.02, "norm_std": 0.0}),
    "qwen3": (config(model_type="qwen3", head_dim=6, hidden_size=16), {}),
    "qwen2_tokenizer": (config(model_type="qwen2"), {"tokenizer_dir": os.path.join(root, "demo", "tokenizer")}),
    "qwen3_moe": (qwen3_moe_config(), {}),
    "qwen3_5": (qwen3_5_config(), {}),
    "qwen3_5_moe": (qwen3_5_moe_config(), {}),
    "gpt_oss": (gpt_oss_config(), {}),
    "glm4_moe": (glm4_moe_config(), {}),
    "phi3": (phi3_config(), {}),
    "phi3_tied": (phi3_config(tie_word_embeddings=True), {}),
}
failures = 0
with tempfile.TemporaryDirectory() as tmp:
    data = os.path.join(tmp, "doc.jsonl")
    with open(data, "w") as f:
        ids = [(7 * i + 3) % 64 for i in range(20)]
        f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")
    for name, (c, options) in cases.items():
        model = os.path.join(tmp, name)
        written = write_model(model, c, seed=4, **options)
        out = subprocess.run([spindle, "eval", "--model", model, "--data", data], capture_output=True, text=True)
        ok = out.returncode == 0 and math.isfinite(json.loads(out.stdout)["loss"])
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name} (vocab {written['vocab_size']}): "
              f"{out.stdout.strip() if ok else out.stderr.strip()}")
sys.exit(1 if failures else 0)
