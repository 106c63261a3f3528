"""The tiny GQA Llama both parity scripts train: 4 query heads, 2 KV heads (Ulysses 4 replicates KV
heads), hidden 32, 2 layers, untied embeddings, random weights (numpy + safetensors)."""
import json
import os
import shutil

import numpy as np
from safetensors.numpy import save_file


def make_model(path, vocab=64, heads=4, kv_heads=2, hidden=32, layers=2, seed=1, tokenizer_dir=None):
    """Writes config.json and model.safetensors to `path`; with tokenizer_dir, its tokenizer files
    are copied and the vocabulary is the tokenizer's."""
    os.makedirs(path, exist_ok=True)
    extra = {}
    if tokenizer_dir:
        tokenizer = json.load(open(os.path.join(tokenizer_dir, "tokenizer.json")))
        vocab = max([t["id"] for t in tokenizer["added_tokens"]] + list(tokenizer["model"]["vocab"].values())) + 1
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
        extra["eos_token_id"] = 2
    head_dim = hidden // heads
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": 48, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "max_position_embeddings": 256, "torch_dtype": "float32", **extra}
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden), "model.norm.weight": None}
    for l in range(layers):
        p = f"model.layers.{l}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                       p + "mlp.gate_proj.weight": (48, hidden), p + "mlp.up_proj.weight": (48, hidden),
                       p + "mlp.down_proj.weight": (hidden, 48),
                       p + "input_layernorm.weight": None, p + "post_attention_layernorm.weight": None})
    tensors = {}
    for name, shape in shapes.items():
        if shape is None:
            tensors[name] = (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
        else:
            tensors[name] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
    save_file(tensors, os.path.join(path, "model.safetensors"))
