#!/usr/bin/env python3
"""Creates the demo's tiny Qwen2-architecture model with random weights (initialised as transformers
initialises a new model: normal(0, 0.02), norms 1, biases 0) next to the shipped tokenizer, so the
demo fine-tunes from scratch without downloading anything."""
import argparse
import json
import os
import shutil

import numpy as np
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("output", help="model folder to create")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--intermediate-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tokenizer_dir = os.path.join(HERE, "tokenizer")
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    ids = [t["id"] for t in tokenizer["added_tokens"]] + list(tokenizer["model"]["vocab"].values())
    vocab_size = max(ids) + 1
    special = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}

    hidden, inter, heads, kv_heads = args.hidden_size, args.intermediate_size, args.heads, args.kv_heads
    head_dim = hidden // heads
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": args.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "bos_token_id": None,
        "eos_token_id": special["<|im_end|>"],
        "pad_token_id": special["<|endoftext|>"],
        "torch_dtype": "float32",
    }

    rng = np.random.default_rng(args.seed)

    def normal(*shape):
        return rng.normal(0.0, 0.02, size=shape).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(vocab_size, hidden),
               "model.norm.weight": np.ones(hidden, np.float32)}
    for layer in range(args.layers):
        p = f"model.layers.{layer}."
        tensors.update({
            p + "input_layernorm.weight": np.ones(hidden, np.float32),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float32),
            p + "self_attn.q_proj.weight": normal(heads * head_dim, hidden),
            p + "self_attn.q_proj.bias": np.zeros(heads * head_dim, np.float32),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.k_proj.bias": np.zeros(kv_heads * head_dim, np.float32),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.bias": np.zeros(kv_heads * head_dim, np.float32),
            p + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": normal(inter, hidden),
            p + "mlp.up_proj.weight": normal(inter, hidden),
            p + "mlp.down_proj.weight": normal(hidden, inter),
        })

    os.makedirs(args.output, exist_ok=True)
    with open(os.path.join(args.output, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    save_file(tensors, os.path.join(args.output, "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(args.output, name))
    parameters = sum(t.size for t in tensors.values())
    print(f"created {args.output}: Qwen2 architecture, {args.layers} layers, hidden {hidden}, "
          f"vocab {vocab_size}, {parameters / 1e6:.2f}M parameters, random weights (seed {args.seed})")


if __name__ == "__main__":
    main()
