"""Tiny decoder models for the Python test scripts and the demo: a Hugging Face config.json of a
family and size, and a model folder holding it with random weights (numpy + safetensors).

The C++ tests' counterpart is tests/support/tiny_model.h; both default to the tiny GQA llama the
parity checks train (4 query heads over 2 KV heads, so Ulysses 4 replicates KV heads). The tensors
follow from the config (qwen2: q/k/v biases; qwen3: q/k norms; qwen3_moe: routers and experts;
qwen3_5_moe: a shared expert too; glm4_moe: a dense first layer, the routers' correction biases and
ungated shared experts; phi3: fused qkv_proj and gate_up_proj; no lm_head when tied), so a new family or
layer kind is a new entry in `layer_tensors` and its config keys, not a new maker.

    from tiny_model import config, write_model
    write_model(path, config(model_type="qwen2", hidden_size=64), seed=3)
"""
import json
import os
import shutil

import numpy as np
from safetensors.numpy import save_file

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                 "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                 "gpt_oss": "GptOssForCausalLM",
                 "glm4_moe": "Glm4MoeForCausalLM",
                 "phi3": "Phi3ForCausalLM"}


def config(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=None, rms_norm_eps=1e-5, rope_theta=10000.0,
           tie_word_embeddings=False, max_position_embeddings=256, **extra):
    """The config.json dict; `extra` adds or overrides keys as given (a family not in ARCHITECTURES
    names its class there). head_dim defaults to hidden_size / num_attention_heads, as in transformers."""
    c = {"model_type": model_type, "vocab_size": vocab_size,
         "hidden_size": hidden_size, "intermediate_size": intermediate_size, "num_hidden_layers": num_hidden_layers,
         "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
         "head_dim": head_dim or hidden_size // num_attention_heads, "hidden_act": "silu",
         "rms_norm_eps": rms_norm_eps, "rope_theta": rope_theta, "tie_word_embeddings": tie_word_embeddings,
         "max_position_embeddings": max_position_embeddings, "torch_dtype": "float32"}
    if model_type in ARCHITECTURES:
        c["architectures"] = [ARCHITECTURES[model_type]]
    c.update(extra)
    return c


def qwen3_moe_config(**overrides):
    """qwen3_moe as tests/support/tiny_model.h's tiny_qwen3_moe(): 3 layers, the middle one dense
    (mlp_only_layers), the others 4 experts of width 12 with 2 per token, renormalised; no router
    load-balancing loss unless the caller turns output_router_logits on."""
    c = dict(model_type="qwen3_moe", num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=12, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
             output_router_logits=False, router_aux_loss_coef=0.001)
    c.update(overrides)
    return config(**c)


def mistral_config(**overrides):
    """mistral: llama without biases, every layer a sliding window of 5 keys (shorter than most
    documents of the parity data, and than the shards of a 48-token row over 4 ranks)."""
    c = dict(model_type="mistral", sliding_window=5, architectures=["MistralForCausalLM"])
    c.update(overrides)
    return config(**c)


def gemma2_config(**overrides):
    """gemma2: a sliding layer (window 5) then a full one, soft-capped attention and final logits,
    query_pre_attn_scalar, sandwich (1 + w) norms, GeGLU, √hidden embeddings, tied head."""
    c = dict(model_type="gemma2", sliding_window=5, query_pre_attn_scalar=6, attn_logit_softcapping=3.0,
             final_logit_softcapping=5.0, hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
             tie_word_embeddings=True, architectures=["Gemma2ForCausalLM"])
    c.update(overrides)
    return config(**c)


def gemma3_text_config(**overrides):
    """gemma3_text: q/k norms, a sliding layer with its own RoPE then a full one."""
    c = dict(model_type="gemma3_text", sliding_window=5, hidden_activation="gelu_pytorch_tanh",
             hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, rope_local_base_freq=100.0,
             layer_types=["sliding_attention", "full_attention"], architectures=["Gemma3ForCausalLM"])
    c.update(overrides)
    return config(**c)


def gpt_oss_config(**overrides):
    """gpt_oss as tests/support/tiny_model.h's tiny_gpt_oss(): a sliding layer (window 4) then a full one,
    sinks on both, q/k/v/o biases; every layer 4 experts of width 12 (intermediate_size), 2 per token, with
    the biased router and the clamped SwiGLU, stored as transformers saves them ([E, in, out] and biases);
    no load-balancing loss unless the caller turns output_router_logits on."""
    c = dict(model_type="gpt_oss", intermediate_size=12, layer_types=["sliding_attention", "full_attention"],
             sliding_window=4, attention_bias=True, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=7.0,
             output_router_logits=False, router_aux_loss_coef=0.9)
    c.update(overrides)
    return config(**c)


def glm4_moe_config(**overrides):
    """glm4_moe as tests/support/tiny_model.h's tiny_glm4_moe(): 3 layers, the first dense (first_k_dense_replace
    1), the others 8 experts of width 12 in 4 groups of 2, 3 per token from the best 2 groups (the sigmoid router
    with its correction bias, renormalised, scaled by 2.5) plus one ungated shared expert of width 12; q/k/v
    biases, q/k norms, RoPE on half of each head. write_model draws the correction biases N(0, 0.1²), enough
    to change some tokens' experts."""
    c = dict(model_type="glm4_moe", num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8,
             num_experts_per_tok=3, moe_intermediate_size=12, n_shared_experts=1, n_group=4, topk_group=2,
             norm_topk_prob=True, routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True,
             partial_rotary_factor=0.5, num_nextn_predict_layers=0)
    c.update(overrides)
    return config(**c)


def phi3_config(**overrides):
    """phi3 as tests/support/tiny_model.h's tiny_phi3(): q/k/v in one projection (qkv_proj), gate/up in one
    (gate_up_proj), a sliding window of 6 on every layer, LongRoPE (v4 spelling) on 0.75 of each head with an
    original window of 12: documents of 13 tokens and more rotate with the long factors."""
    c = dict(model_type="phi3", original_max_position_embeddings=12, sliding_window=6, partial_rotary_factor=0.75,
             rope_scaling={"type": "longrope", "short_factor": [1.05, 1.1, 1.2], "long_factor": [1.5, 4.0, 9.0]})
    c.update(overrides)
    return config(**c)


def is_moe_layer(c, layer):
    """transformers' rule for qwen3_moe and qwen3_next: sparse unless in mlp_only_layers, every decoder_sparse_step-th layer;
    gpt_oss: every layer; glm4_moe: from first_k_dense_replace on."""
    if c["model_type"] == "gpt_oss":
        return True
    if c["model_type"] == "glm4_moe":
        return layer >= c.get("first_k_dense_replace", 1)
    if c["model_type"] not in ("qwen3_moe", "qwen3_next"):
        return False
    return layer not in c.get("mlp_only_layers", []) and (layer + 1) % c.get("decoder_sparse_step", 1) == 0


def qwen3_5_config(**overrides):
    """qwen3_5 (text-only) as tests/support/tiny_model.h's tiny_qwen3_5(): gated DeltaNet, gated attention,
    gated DeltaNet; DeltaNet 2 key heads and 4 value heads of 8, conv kernel 4; RoPE on half the head."""
    c = dict(model_type="qwen3_5_text", num_hidden_layers=3,
             layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
             partial_rotary_factor=0.5)
    c.update(overrides)
    return config(**c)


def qwen3_5_moe_config(**overrides):
    """qwen3_5_moe (text-only) as tests/support/tiny_model.h's tiny_qwen3_5_moe(): qwen3_5_config()'s layers,
    each with 4 experts of width 12 (2 per token, always renormalised) and a shared expert of width 16
    behind its sigmoid gate; no dense intermediate_size (the family has none); no load-balancing loss
    unless the caller turns output_router_logits on."""
    c = qwen3_5_config(model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                       shared_expert_intermediate_size=16, output_router_logits=False, router_aux_loss_coef=0.001)
    c["architectures"] = [ARCHITECTURES["qwen3_5_moe_text"]]
    del c["intermediate_size"]
    c.update(overrides)
    return c


def qwen3_next_config(**overrides):
    """qwen3_next: qwen3_5_moe_config()'s layers with the DeltaNet projections fused per key head
    (in_proj_qkvz, in_proj_ba), the middle layer a dense SwiGLU of width 20 (mlp_only_layers), the router
    renormalising the top-k (norm_topk_prob)."""
    c = qwen3_5_moe_config(model_type="qwen3_next", intermediate_size=20, mlp_only_layers=[1], decoder_sparse_step=1,
                           norm_topk_prob=True)
    c["architectures"] = [ARCHITECTURES["qwen3_next"]]
    c.update(overrides)
    return c


def routed_expert_tensors(c, p):
    """(name, shape, kind) of a MoE feed-forward's router and per-expert projections (gpt_oss: the biased
    router and the fused [E, in, out] experts with their biases, as transformers saves them)."""
    if c["model_type"] == "gpt_oss":
        h, experts, width = c["hidden_size"], c["num_local_experts"], c["intermediate_size"]
        return [(p + "mlp.router.weight", (experts, h), "matrix"), (p + "mlp.router.bias", (experts,), "bias"),
                (p + "mlp.experts.gate_up_proj", (experts, h, 2 * width), "matrix"),
                (p + "mlp.experts.gate_up_proj_bias", (experts, 2 * width), "bias"),
                (p + "mlp.experts.down_proj", (experts, width, h), "matrix"),
                (p + "mlp.experts.down_proj_bias", (experts, h), "bias")]
    if c["model_type"] == "glm4_moe":  # the router's correction bias (F32, for the choice only) and shared experts
        h, experts, width = c["hidden_size"], c["n_routed_experts"], c["moe_intermediate_size"]
        shared = width * c.get("n_shared_experts", 1)
        out = [(p + "mlp.gate.weight", (experts, h), "matrix"),
               (p + "mlp.gate.e_score_correction_bias", (experts,), "correction")]
        for e in range(experts):
            out += [(p + f"mlp.experts.{e}.gate_proj.weight", (width, h), "matrix"),
                    (p + f"mlp.experts.{e}.up_proj.weight", (width, h), "matrix"),
                    (p + f"mlp.experts.{e}.down_proj.weight", (h, width), "matrix")]
        return out + [(p + "mlp.shared_experts.gate_proj.weight", (shared, h), "matrix"),
                      (p + "mlp.shared_experts.up_proj.weight", (shared, h), "matrix"),
                      (p + "mlp.shared_experts.down_proj.weight", (h, shared), "matrix")]
    h, experts, width = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"]
    out = [(p + "mlp.gate.weight", (experts, h), "matrix")]
    for e in range(experts):
        out += [(p + f"mlp.experts.{e}.gate_proj.weight", (width, h), "matrix"),
                (p + f"mlp.experts.{e}.up_proj.weight", (width, h), "matrix"),
                (p + f"mlp.experts.{e}.down_proj.weight", (h, width), "matrix")]
    return out


def deltanet_tensors(c, p):
    """(name, shape, kind) of a gated DeltaNet layer's mixer (qwen3_5 "linear_attention" layers); A_log and
    dt_bias drawn as biases (zero: exp(A_log) = 1)."""
    h = c["hidden_size"]
    key = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    heads, value = c["linear_num_value_heads"], c["linear_num_value_heads"] * c["linear_value_head_dim"]
    a = p + "linear_attn."
    if c["model_type"] == "qwen3_next":  # rows grouped per key head: q, k, v, z; then b, a
        projections = [(a + "in_proj_qkvz.weight", (2 * key + 2 * value, h), "matrix"),
                       (a + "in_proj_ba.weight", (2 * heads, h), "matrix")]
    else:
        projections = [(a + "in_proj_qkv.weight", (2 * key + value, h), "matrix"),
                       (a + "in_proj_z.weight", (value, h), "matrix"), (a + "in_proj_b.weight", (heads, h), "matrix"),
                       (a + "in_proj_a.weight", (heads, h), "matrix")]
    return projections + [
            (a + "conv1d.weight", (2 * key + value, 1, c["linear_conv_kernel_dim"]), "matrix"),
            (a + "dt_bias", (heads,), "bias"), (a + "A_log", (heads,), "bias"),
            (a + "norm.weight", (c["linear_value_head_dim"],), "norm"), (a + "out_proj.weight", (h, value), "matrix")]


def layer_tensors(c, layer):
    """(name, shape, kind) of one decoder layer, kind "matrix", "bias", "norm" or "sink"."""
    h, inter, d = c["hidden_size"], c.get("intermediate_size"), c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    if c["model_type"] in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):
        p = f"model.layers.{layer}."
        if c["layer_types"][layer] == "linear_attention":
            mixer = deltanet_tensors(c, p)
        else:  # gated attention: q_proj holds each head's query and gate rows; (1 + w) q/k norms
            mixer = [(p + "self_attn.q_proj.weight", (2 * q, h), "matrix"),
                     (p + "self_attn.k_proj.weight", (kv, h), "matrix"),
                     (p + "self_attn.v_proj.weight", (kv, h), "matrix"),
                     (p + "self_attn.o_proj.weight", (h, q), "matrix"),
                     (p + "self_attn.q_norm.weight", (d,), "norm"), (p + "self_attn.k_norm.weight", (d,), "norm")]
        norms = [(p + "input_layernorm.weight", (h,), "norm"), (p + "post_attention_layernorm.weight", (h,), "norm")]
        moe = c["model_type"] == "qwen3_5_moe_text" or (c["model_type"] == "qwen3_next" and is_moe_layer(c, layer))
        if moe:  # routed experts, a shared expert and its gate
            shared = c["shared_expert_intermediate_size"]
            return mixer + routed_expert_tensors(c, p) + [
                (p + "mlp.shared_expert.gate_proj.weight", (shared, h), "matrix"),
                (p + "mlp.shared_expert.up_proj.weight", (shared, h), "matrix"),
                (p + "mlp.shared_expert.down_proj.weight", (h, shared), "matrix"),
                (p + "mlp.shared_expert_gate.weight", (1, h), "matrix")] + norms
        return mixer + [(p + "mlp.gate_proj.weight", (inter, h), "matrix"),
                        (p + "mlp.up_proj.weight", (inter, h), "matrix"),
                        (p + "mlp.down_proj.weight", (h, inter), "matrix")] + norms
    qkv_bias = c["model_type"] == "qwen2" or c.get("attention_bias", False)
    o_bias = c["model_type"] not in ("qwen2", "glm4_moe") and c.get("attention_bias", False)
    p = f"model.layers.{layer}."
    out = []
    if c["model_type"] == "phi3":  # q, k, v in one projection; gate, up in one
        return [(p + "self_attn.qkv_proj.weight", (q + 2 * kv, h), "matrix"),
                (p + "self_attn.o_proj.weight", (h, q), "matrix"),
                (p + "mlp.gate_up_proj.weight", (2 * inter, h), "matrix"),
                (p + "mlp.down_proj.weight", (h, inter), "matrix"),
                (p + "input_layernorm.weight", (h,), "norm"), (p + "post_attention_layernorm.weight", (h,), "norm")]
    for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out.append((p + f"self_attn.{proj}.weight", (rows, h), "matrix"))
        if qkv_bias:
            out.append((p + f"self_attn.{proj}.bias", (rows,), "bias"))
    out.append((p + "self_attn.o_proj.weight", (h, q), "matrix"))
    if o_bias:
        out.append((p + "self_attn.o_proj.bias", (h,), "bias"))
    if c["model_type"] == "gpt_oss":  # one sink logit per query head
        out.append((p + "self_attn.sinks", (c["num_attention_heads"],), "sink"))
    if is_moe_layer(c, layer):
        out += routed_expert_tensors(c, p)
    else:
        out += [(p + "mlp.gate_proj.weight", (inter, h), "matrix"), (p + "mlp.up_proj.weight", (inter, h), "matrix"),
                (p + "mlp.down_proj.weight", (h, inter), "matrix")]
    out += [(p + "input_layernorm.weight", (h,), "norm"), (p + "post_attention_layernorm.weight", (h,), "norm")]
    if c["model_type"] in ("gemma2", "gemma3_text"):  # sandwich norms around the MLP too
        out += [(p + "pre_feedforward_layernorm.weight", (h,), "norm"),
                (p + "post_feedforward_layernorm.weight", (h,), "norm")]
    if c["model_type"] in ("qwen3", "qwen3_moe", "gemma3_text") or c.get("use_qk_norm", False):
        out += [(p + "self_attn.q_norm.weight", (d,), "norm"), (p + "self_attn.k_norm.weight", (d,), "norm")]
    return out


def model_tensors(c):
    """(name, shape, kind) of every tensor of the model, in the order weights are drawn."""
    h, v = c["hidden_size"], c["vocab_size"]
    out = [("model.embed_tokens.weight", (v, h), "matrix")]
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", (v, h), "matrix"))
    out.append(("model.norm.weight", (h,), "norm"))
    for layer in range(c["num_hidden_layers"]):
        out += layer_tensors(c, layer)
    return out


def write_model(path, c, seed=1, weight_std=0.2, norm_std=0.1, tokenizer_dir=None):
    """Writes config.json and model.safetensors (F32) to `path`, weights drawn from one generator
    seeded `seed` in model_tensors order: matrices N(0, weight_std²), norms 1 + N(0, norm_std²)
    (exactly 1 with norm_std 0), biases 0, attention sinks N(0, 1) (a visible share of every softmax row), glm4_moe's
    correction biases N(0, 0.1²). The defaults spread the weights well beyond a new
    model's (weight_std 0.02, norm_std 0: as transformers initialises one) so that attention is far
    from uniform and every parameter gets a visible gradient. With tokenizer_dir, its tokenizer
    files are copied, the vocabulary is the tokenizer's and the special token ids are its own.
    Returns the config written."""
    c = dict(c)
    if tokenizer_dir:
        tokenizer = json.load(open(os.path.join(tokenizer_dir, "tokenizer.json")))
        tokenizer_config = json.load(open(os.path.join(tokenizer_dir, "tokenizer_config.json")))
        added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
        c["vocab_size"] = max(list(added.values()) + list(tokenizer["model"]["vocab"].values())) + 1
        for role in ("bos", "eos", "pad"):
            token = tokenizer_config.get(f"{role}_token")  # a string, an AddedToken dict or null
            c[f"{role}_token_id"] = added.get(token["content"] if isinstance(token, dict) else token)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape, kind in model_tensors(c):
        if kind == "matrix":
            tensors[name] = (weight_std * rng.standard_normal(shape)).astype(np.float32)
        elif kind == "sink":
            tensors[name] = rng.standard_normal(shape).astype(np.float32)
        elif kind == "correction":
            tensors[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
        elif kind == "norm":
            values = 1.0 + norm_std * rng.standard_normal(shape) if norm_std else np.ones(shape)
            tensors[name] = values.astype(np.float32)
        else:
            tensors[name] = np.zeros(shape, np.float32)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
        f.write("\n")
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_dir:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tokenizer_dir, name), path)
    return c


def parameter_count(c):
    """As transformers counts them: parameters, not buffers (glm4_moe's correction biases)."""
    return sum(int(np.prod(shape)) for _, shape, kind in model_tensors(c) if kind != "correction")
