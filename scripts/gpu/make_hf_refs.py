#!/usr/bin/env python3
"""Makes the HF parity references that tests/model checks spindle against.

Runs where transformers and peft are installed (the GPU host; it computes on the CPU in fp32 so
no TF32 or kernel choice blurs the reference). For each tiny random model it writes, under OUT/<case>/:
  config.json, model.safetensors      the model as transformers saves it (fp32)
  adapter/                            a PEFT adapter (LoRA cases only), B nonzero
  data.jsonl                          pre-tokenized documents: input_ids, labels (-100 = prompt), loss_scale
  expected.safetensors                loss (F64[1]), num_items (I64[1]), logits (F32[tokens, vocab], the
                                      documents concatenated), grad.<parameter name> for every trainable tensor
  bf16_noise.json                     with --bf16-noise, for cases already written (no other file changes):
                                      how far BF16 moves each gradient tensor (bf16_noise below), the bound
                                      of the GPU model test's BF16 steps
The loss is docs/design.md §2.2: Σ loss_scale·CE over supervised targets / number of supervised targets, where
document d's position i predicts labels[i+1] of the same document. Each document is run on its own, so
the reference needs no packing support from transformers: packing must reproduce it exactly.

Gated DeltaNet cases (qwen3_5) give every DeltaNet head a slow decay (slow_deltanet_decay): a state
leaking from one packed document into the next would then change the loss well beyond rounding.

Mixture-of-experts cases (qwen3_moe; qwen3_5_moe when its text config has output_router_logits) train with
the router load-balancing loss: expected.safetensors then
also holds aux_loss (F64[1]), transformers' load_balancing_loss_func over the raw router logits of every
document and MoE layer at once (the whole step, as spindle defines it), and the gradients are those of
loss + router_aux_loss_coef · aux_loss. Their routers are decisive (no top-k near-tie on any token) so that
neither F32 nor BF16 rounding changes a routing decision (ROUTER_MARGIN).

qwen3_5_moe is the multimodal Qwen3_5MoeForConditionalGeneration (a tiny vision tower, fused experts as the
released checkpoints hold them, text model under model.language_model.); the vision tower is frozen (spindle
never trains it) and model.safetensors also gets a few mtp.* tensors, which transformers ignores on load and
spindle carries into a saved full model. qwen3_5_moe_text is the text-only Qwen3_5MoeForCausalLM.

gpt_oss (gpt_oss, gpt_oss_lora) is a MoE case too: its routers (mlp.router) have a bias, its experts are
transformers' GptOssExperts tensors [E, in, out] with biases (saved so, as spindle reads them), some of whose
gate/up values are drawn past the clamped SwiGLU's limit (gpt_oss_experts_past_the_limit), and its
attention sinks are drawn away from zero (N(0, 1)) so that they take a visible share of every softmax row.

glm4_moe (glm4_moe, glm4_moe_lora, glm4_moe_expert_lora, glm4_moe_v4) has no load-balancing loss (transformers
defines none for it). Its routers are Glm4MoeTopkRouter: sigmoid scores, e_score_correction_bias (a buffer) added
for the choice only, group-limited top-k. The correction biases are drawn large enough that they change a
visible share of the routing decisions, and the routers are redrawn until no decision (the topk_group-th group
against the next, the k-th candidate against the next) is closer than GLM4_MARGIN (make_glm4_routers_decisive);
expected.json records how many decisions the biases and the group limit change. glm4_moe_v4 writes its RoPE in
the transformers-4 spelling (rope_theta, rope_scaling null, partial_rotary_factor at the top, as the released
GLM-4.5 config.json) and appends an MTP layer (model.layers.{num_hidden_layers}.*) to model.safetensors, which
transformers does not load and spindle carries into a saved full model.

The expert LoRA cases (qwen3_moe_expert_lora, qwen3_5_moe_expert_lora, glm4_moe_expert_lora) adapt the routed experts' fused
tensors through PEFT's target_parameters (ParamWrapper: per expert e, W_e + s·B_e·A_e), so their
adapters and gradients are in PEFT's layout for them: lora_A [E·r, in], lora_B [out, r·E] (docs/formats.md).

Usage: python3 make_hf_refs.py [OUT_DIR | --out OUT_DIR] [--only CASE[,CASE...]]
"""
import argparse
import json
import os
import re
import sys
import zlib

import torch
import transformers
from safetensors.torch import load_file, save_file

torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
_parser = argparse.ArgumentParser()
_parser.add_argument("out_dir", nargs="?", default=None)
_parser.add_argument("--out", default=None)
_parser.add_argument("--only", default=None, help="comma-separated case names (default: every case)")
_parser.add_argument("--bf16-noise", action="store_true",
                     help="write nothing new but <case>/bf16_noise.json for the cases already in OUT (see bf16_noise)")
ARGS = _parser.parse_args()
OUT = ARGS.out or ARGS.out_dir or "testdata/hf"
ONLY = set(ARGS.only.split(",")) if ARGS.only else None

VOCAB = 96
# Where multimodal checkpoints keep what text-only training never runs (Qwen3.5's and Gemma 3's towers).
VISION_PREFIXES = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.")
# The model types whose feed-forwards are routed experts (router load-balancing loss, decisive routers).
MOE_TYPES = ("qwen3_moe", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "gpt_oss", "glm4_moe")


def documents(rng):
    """Documents of varied lengths: prompt masking, loss_scale, one with no target, one of one token."""
    docs = []
    for length, prompt in [(9, 3), (17, 6), (5, 0), (1, 0), (23, 10), (4, 4), (12, 2)]:
        ids = torch.randint(0, VOCAB, (length,), generator=rng).tolist()
        labels = [-100] * prompt + ids[prompt:]
        scale = [float(x) for x in torch.randint(1, 5, (length,), generator=rng) / 2.0]
        docs.append({"input_ids": ids, "labels": labels, "loss_scale": scale})
    return docs


def text_config(config):
    """The decoder's config: a multimodal config's text_config, or the config itself."""
    return getattr(config, "text_config", None) or config


def reference(model, docs, trainable):
    """Loss, num_items, logits and gradients of docs/design.md §2.2 for documents run one at a time."""
    model.zero_grad(set_to_none=True)
    num_items = sum(sum(1 for t in d["labels"][1:] if t != -100) for d in docs)
    total = torch.zeros((), dtype=torch.float64)
    all_logits = []
    for d in docs:
        ids = torch.tensor([d["input_ids"]])
        logits = model(input_ids=ids, use_cache=False).logits[0].float()  # [L, V]
        all_logits.append(logits.detach())
        labels = torch.tensor(d["labels"][1:])
        scale = torch.tensor(d["loss_scale"][1:], dtype=torch.float32)
        mask = labels != -100
        if mask.any():
            ce = torch.nn.functional.cross_entropy(logits[:-1][mask], labels[mask], reduction="none")
            part = (ce * scale[mask]).sum() / num_items
            part.backward()
            total += part.detach().double()
    out = {
        "loss": total.reshape(1),
        "num_items": torch.tensor([num_items], dtype=torch.int64),
        "logits": torch.cat(all_logits).contiguous(),
    }
    for name, p in trainable:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out["grad." + name] = g.detach().float().contiguous()
    return out, float(total)


class RouterLogits:
    """Raw router logits of every MoE layer (x·W_gᵀ, + b for gpt_oss's biased mlp.router; differentiable),
    recorded by forward hooks on the routers; in transformers 5 the router module's own first output is its
    softmax, not the logits."""

    def __init__(self, model):
        self.logits = []
        self.handles = [m.register_forward_hook(self.hook) for n, m in model.named_modules()
                        if n.endswith(("mlp.gate", "mlp.router")) and hasattr(m, "weight")]
        assert self.handles, "no MoE router found"

    def hook(self, module, inputs, output):
        x = inputs[0]
        bias = getattr(module, "bias", None)
        self.logits.append(torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), module.weight, bias))

    def close(self):
        for h in self.handles:
            h.remove()


def load_balancing_loss(config, router_logits):
    """The model family's own load_balancing_loss_func over the raw router logits of every layer and token."""
    if config.model_type == "gpt_oss":
        from transformers.models.gpt_oss import modeling_gpt_oss as family
    else:
        from transformers.models.qwen3_moe import modeling_qwen3_moe as family
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    return family.load_balancing_loss_func(tuple(router_logits), experts, config.num_experts_per_tok, None)


def reference_moe(model, docs, trainable, config):
    """reference() plus the router load-balancing loss over all documents and MoE layers together."""
    config = text_config(config)
    model.zero_grad(set_to_none=True)
    num_items = sum(sum(1 for t in d["labels"][1:] if t != -100) for d in docs)
    routers = RouterLogits(model)
    parts, all_logits = [], []
    for d in docs:
        ids = torch.tensor([d["input_ids"]])
        logits = model(input_ids=ids).logits[0].float()
        all_logits.append(logits.detach())
        labels = torch.tensor(d["labels"][1:])
        scale = torch.tensor(d["loss_scale"][1:], dtype=torch.float32)
        mask = labels != -100
        if mask.any():
            ce = torch.nn.functional.cross_entropy(logits[:-1][mask], labels[mask], reduction="none")
            parts.append((ce * scale[mask]).sum() / num_items)
    routers.close()
    aux = load_balancing_loss(config, routers.logits)
    ce_total = torch.stack(parts).sum()
    (ce_total + config.router_aux_loss_coef * aux).backward()
    out = {
        "loss": ce_total.detach().double().reshape(1),
        "aux_loss": aux.detach().double().reshape(1),
        "num_items": torch.tensor([num_items], dtype=torch.int64),
        "logits": torch.cat(all_logits).contiguous(),
    }
    for name, p in trainable:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out["grad." + name] = g.detach().float().contiguous()
    return out, float(ce_total)


# The smallest gap between a token's k-th and (k+1)-th router logit the MoE references accept. The
# references check F32 and F64 (rounding of a logit ~1e-6) and, on the GPU, BF16 steps (tests/cuda/
# test_cuda_model.cpp): BF16 rounds every activation to 2^-9 relative, which moves these tiny models'
# router logits by up to ~1e-2, and one token sent to another expert changes the gradients by tens of
# percent. 5e-2 keeps every BF16 routing decision equal to the F32 one.
ROUTER_MARGIN = 5e-2


def router_margin(model, docs, k):
    """The smallest gap between a token's k-th and (k+1)-th router logit, over every MoE layer. The
    logits decide the top-k (the softmax keeps their order); a gap above ROUTER_MARGIN makes spindle (F32,
    F64, BF16) and transformers pick the same experts. (The gap of the probabilities is no measure: a
    confident router gives its second and third choices probabilities of 1e-6 and 1e-7, a tiny difference
    between clearly ordered logits.)"""
    model.eval()
    routers = RouterLogits(model)
    with torch.no_grad():
        for d in docs:
            model(input_ids=torch.tensor([d["input_ids"]]))
    routers.close()
    margin = float("inf")
    for logits in routers.logits:
        top = logits.double().sort(dim=-1, descending=True).values
        margin = min(margin, float((top[:, k - 1] - top[:, k]).min()))
    return margin


def make_routers_decisive(model, docs, config, seed):
    """Router weights large enough that routing is far from uniform, redrawn until no token has a
    top-k near-tie (router logits closer than ROUTER_MARGIN) in any MoE layer and, for gpt_oss, no expert
    gate/up value within CLAMP_MARGIN of a clamp bound."""
    rng = torch.Generator().manual_seed(seed + 1)
    margins = []
    for attempt in range(200):
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(("mlp.gate.weight", "mlp.router.weight")):
                    p.copy_(0.3 * torch.randn(p.shape, generator=rng))
        margin = router_margin(model, docs, config.num_experts_per_tok)
        margins.append(margin)
        if margin > ROUTER_MARGIN and (config.model_type != "gpt_oss" or clamp_margin(model, docs) > CLAMP_MARGIN):
            print(f"  routers decisive after {attempt + 1} draw(s): smallest top-k margin {margin:.2e}")
            return margin
    raise SystemExit(f"no decisive router draw found; smallest top-k margins of the draws: "
                     f"{' '.join(f'{m:.1e}' for m in margins)}")


# glm4_moe: the smallest gap at a routing decision (sigmoid scores plus correction bias, in [0, 1] + bias)
# the references accept. They are checked in F32 and F64 on the CPU only (the family is CPU-only): a
# different summation order moves these routers' F32 logits by ~1e-6 and a score by a quarter of that, so
# 1e-4 keeps every decision of spindle's F32 and F64 steps equal to transformers' F32 one (ROUTER_MARGIN's
# BF16 allowance would need gaps no draw over 142 token-layer decisions of 8 experts gives).
GLM4_MARGIN = 1e-4


class RouterInputs:
    """The inputs of every glm4_moe router (Glm4MoeTopkRouter, the "mlp.gate" modules), recorded by forward hooks."""

    def __init__(self, model):
        self.inputs, self.routers = [], []
        self.handles = []
        for n, m in model.named_modules():
            if n.endswith("mlp.gate") and hasattr(m, "e_score_correction_bias"):
                self.routers.append(m)
                self.handles.append(m.register_forward_hook(
                    lambda module, args, out: self.inputs.append((module, args[0].detach()))))
        assert self.routers, "no glm4_moe router found"

    def close(self):
        for h in self.handles:
            h.remove()


def glm4_choices(router, x, use_bias=True, use_groups=True):
    """Glm4MoeTopkRouter's choice in float64: the chosen experts (sorted) of every token, and the smallest gap at
    a decision (the topk_group-th group score against the next, the k-th candidate against the next)."""
    scores = torch.sigmoid(x.reshape(-1, x.shape[-1]).double() @ router.weight.double().t())
    choice = scores + (router.e_score_correction_bias.double() if use_bias else 0.0)
    groups, keep, k = router.num_group, router.topk_group, router.top_k
    if not use_groups:
        groups = keep = 1
    per = router.num_experts // groups
    group_scores = choice.view(-1, groups, per).topk(2, dim=-1)[0].sum(-1)
    ranked = group_scores.sort(dim=-1, descending=True)
    margin = float("inf")
    if keep < groups:
        margin = float((ranked.values[:, keep - 1] - ranked.values[:, keep]).min())
    mask = torch.zeros_like(group_scores).scatter_(1, ranked.indices[:, :keep], 1.0)
    masked = choice.masked_fill(~mask.repeat_interleave(per, dim=1).bool(), float("-inf"))
    top = masked.sort(dim=-1, descending=True)
    if k < keep * per:
        margin = min(margin, float((top.values[:, k - 1] - top.values[:, k]).min()))
    return top.indices[:, :k].sort(dim=-1).values, margin


def glm4_routing_report(model, docs):
    """The smallest decision gap over every router and token, and the shares of (layer, token) choices the
    correction biases and the group limit change."""
    model.eval()
    rec = RouterInputs(model)
    with torch.no_grad():
        for d in docs:
            model(input_ids=torch.tensor([d["input_ids"]]))
    rec.close()
    margin, total, by_bias, by_groups = float("inf"), 0, 0, 0
    with torch.no_grad():
        for router, x in rec.inputs:
            chosen, gap = glm4_choices(router, x)
            margin = min(margin, gap)
            total += chosen.shape[0]
            by_bias += int((chosen != glm4_choices(router, x, use_bias=False)[0]).any(-1).sum())
            by_groups += int((chosen != glm4_choices(router, x, use_groups=False)[0]).any(-1).sum())
    return {"smallest_router_margin": margin, "choices_changed_by_correction_bias": by_bias / total,
            "choices_changed_by_group_limit": by_groups / total if routers_have_groups(model) else None}


def routers_have_groups(model):
    return any(m.topk_group < m.num_group for n, m in model.named_modules() if n.endswith("mlp.gate")
               and hasattr(m, "e_score_correction_bias"))


def make_glm4_routers_decisive(model, docs, seed):
    """Router weights and correction biases redrawn until every routing decision is clear (GLM4_MARGIN) and
    the biases (and, with groups, the group limit) change at least a tenth of the choices."""
    rng = torch.Generator().manual_seed(seed + 1)
    margins = []
    for attempt in range(500):
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("mlp.gate.weight"):
                    p.copy_(0.15 * torch.randn(p.shape, generator=rng))
            for n, b in model.named_buffers():
                if n.endswith("mlp.gate.e_score_correction_bias"):
                    b.copy_(0.25 * torch.randn(b.shape, generator=rng))
        report = glm4_routing_report(model, docs)
        margins.append(report["smallest_router_margin"])
        groups = report["choices_changed_by_group_limit"]
        if (report["smallest_router_margin"] > GLM4_MARGIN and report["choices_changed_by_correction_bias"] >= 0.1
                and (groups is None or groups >= 0.1)):
            print(f"  routers decisive after {attempt + 1} draw(s): {report}")
            return report
    raise SystemExit(f"no decisive glm4_moe router draw found; smallest margins of the draws: "
                     f"{' '.join(f'{m:.1e}' for m in margins[:40])}")


def add_glm4_mtp_layer(folder, config):
    """A multi-token-prediction layer after the last, as GLM-4.5 checkpoints carry one (model.layers.{L}.*:
    eh_proj, enorm, hnorm, shared_head, and a decoder layer's tensors; transformers does not load it)."""
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(11)
    h, layer = config.hidden_size, f"model.layers.{config.num_hidden_layers}."
    tensors[layer + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=gen).to(torch.bfloat16)
    tensors[layer + "enorm.weight"] = torch.randn(h, generator=gen).to(torch.bfloat16)
    tensors[layer + "hnorm.weight"] = torch.randn(h, generator=gen).to(torch.bfloat16)
    tensors[layer + "shared_head.norm.weight"] = torch.randn(h, generator=gen).to(torch.bfloat16)
    tensors[layer + "mlp.gate.e_score_correction_bias"] = torch.randn(config.n_routed_experts, generator=gen)
    tensors[layer + "mlp.experts.0.gate_proj.weight"] = torch.randn(config.moe_intermediate_size, h,
                                                                     generator=gen).to(torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})


class PeftModuleTargetsAsWritten:
    """peft 0.21 on transformers 5 rewrites the target_modules gate_proj/up_proj/down_proj of qwen2_moe-style MoE
    models (glm4_moe, qwen3_moe) into target_parameters on the routed experts' fused tensors, and then adapts no
    dense MLP or shared expert at all (huggingface/peft#3711, open; fix proposed in peft#3715). For the LoRA
    cases on those projections this turns the rewrite off, so PEFT adapts the nn.Linear modules the names match,
    as it does in every other family."""

    def __enter__(self):
        from peft.utils import transformers_weight_conversion as conversion
        self.module, self.kept = conversion, conversion.convert_peft_config_for_transformers
        conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None

    def __exit__(self, *exc):
        self.module.convert_peft_config_for_transformers = self.kept


def expert_layout(folder):
    """How save_pretrained wrote the routed experts: per expert (mlp.experts.N.*_proj.weight) or fused."""
    names = list(load_file(os.path.join(folder, "model.safetensors")).keys())
    if any(".mlp.experts.gate_up_proj" in n for n in names):
        return "fused"
    if any(".mlp.experts.0.gate_proj.weight" in n for n in names):
        return "per_expert"
    return "unknown"


def hf_aux_loss_note(model, docs, config):
    """What transformers' own forward reports as aux_loss for the first document, against
    load_balancing_loss_func on its raw router logits: equal unless the model feeds the function
    probabilities (a softmax applied twice)."""
    config = text_config(config)
    ids = torch.tensor([docs[0]["input_ids"]])
    routers = RouterLogits(model)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids, output_router_logits=True)
    finally:
        routers.close()
    own = float(out.aux_loss) if getattr(out, "aux_loss", None) is not None else None
    raw = float(load_balancing_loss(config, routers.logits))
    first = out.router_logits[0] if getattr(out, "router_logits", None) else None
    probabilities = bool(first is not None and torch.allclose(first.float().sum(-1), torch.ones(first.shape[0])))
    return {"model_aux_loss": own, "aux_loss_from_raw_logits": raw, "router_output_is_probabilities": probabilities}


class RopeTablesPerDocument:
    """For a RoPE whose tables depend on the sequence length (longrope, dynamic), which table transformers
    rotated each document with: recorded by a forward hook on the rotary embedding as the reference runs the
    documents one at a time, and checked against the table of that document's own length. transformers chooses
    from max(position_ids) + 1 in every forward; dynamic NTK keeps the table of the longest sequence since the
    last one shorter than max_position_embeddings (a state spindle does not keep): the check proves the
    documents' order never brought that state into play, so the reference is per document, as spindle is."""

    def __init__(self, model):
        rotary = [m for n, m in model.named_modules() if n.endswith("rotary_emb")]
        assert len(rotary) == 1, "one rotary embedding expected"
        self.module = rotary[0]
        self.tables = []
        self.handle = self.module.register_forward_hook(
            lambda module, args, out: self.tables.append(module.inv_freq.detach().clone()))

    def verify(self, docs):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        self.handle.remove()
        rope = self.module
        config = rope.config
        kind = config.rope_parameters["rope_type"]
        threshold = (config.rope_parameters["original_max_position_embeddings"] if kind == "longrope"
                     else config.max_position_embeddings)
        assert len(self.tables) == len(docs), (len(self.tables), len(docs))
        longer = 0
        for d, used in zip(docs, self.tables):
            n = len(d["input_ids"])
            if n > threshold:
                longer += 1
                # As dynamic_rope_update computes them: longrope from original + 1, dynamic from the tensor length.
                seq_len = torch.tensor(n) if kind == "dynamic" else threshold + 1
                want, _ = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)
            else:
                want = rope.original_inv_freq
            if not torch.equal(used, want):
                raise SystemExit(f"the {n}-token document was rotated with another table than its own length's")
        return {"rope_tables": f"every document rotated with the {kind} table of its own length: {longer} of "
                               f"{len(docs)} longer than {threshold}", "attention_scaling": rope.attention_scaling}


def length_dependent_rope(config):
    params = getattr(text_config(config), "rope_parameters", None) or {}
    return params.get("rope_type") in ("longrope", "dynamic")


# gpt_oss's clamped SwiGLU: gate clamped above at 7, up to [-7, 7] (GptOssExperts.limit).
SWIGLU_LIMIT = 7.0


def gpt_oss_experts_past_the_limit(model, docs):
    """gpt_oss experts whose gate_up projections reach past the clamped SwiGLU's limit: gate_up_proj drawn
    N(0, 0.4²), which puts a few per cent of the routed gate/up values beyond ±7 (so the clamps and their
    zero gradients are exercised), the down projections left small. Returns that share of every expert's
    gate/up values over every token of docs (routed or not)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("mlp.experts.gate_up_proj"):
                p.copy_(0.4 * torch.randn_like(p))
    inputs = []
    handles = [m.register_forward_hook(lambda module, args, out: inputs.append(args[0].detach()))
               for n, m in model.named_modules() if n.endswith("mlp.experts")]
    with torch.no_grad():
        for d in docs:
            model(input_ids=torch.tensor([d["input_ids"]]))
    for h in handles:
        h.remove()
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    past = total = 0
    for i, x in enumerate(inputs):  # one call per document and layer, in layer order
        m = experts[i % len(experts)]
        gu = torch.einsum("th,ehj->etj", x.reshape(-1, x.shape[-1]), m.gate_up_proj) + m.gate_up_proj_bias[:, None, :]
        gate, up = gu[..., 0::2], gu[..., 1::2]
        past += int((gate > SWIGLU_LIMIT).sum() + (up.abs() > SWIGLU_LIMIT).sum())
        total += gu.numel()
    return past / max(total, 1)


# The smallest distance between a gpt_oss gate/up value and a clamp bound (7 for the gate, ±7 for up) the
# references accept. The clamp's derivative jumps there: a value within F32 rounding of a bound is clamped
# in one computation and not in another, which moves the gradients by parts per thousand while the loss
# stays equal.
CLAMP_MARGIN = 1e-4


def clamp_margin(model, docs):
    """The smallest distance of any gpt_oss gate/up value (every token, every expert) from a clamp bound."""
    inputs = []
    handles = [m.register_forward_hook(lambda module, args, out: inputs.append(args[0].detach()))
               for n, m in model.named_modules() if n.endswith("mlp.experts")]
    with torch.no_grad():
        for d in docs:
            model(input_ids=torch.tensor([d["input_ids"]]))
    for h in handles:
        h.remove()
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    margin = float("inf")
    for i, x in enumerate(inputs):
        m = experts[i % len(experts)]
        with torch.no_grad():
            gu = torch.einsum("th,ehj->etj", x.reshape(-1, x.shape[-1]).double(), m.gate_up_proj.double())
            gu = gu + m.gate_up_proj_bias.double()[:, None, :]
        gate, up = gu[..., 0::2], gu[..., 1::2]
        margin = min(margin, float((gate - SWIGLU_LIMIT).abs().min()), float((up.abs() - SWIGLU_LIMIT).abs().min()))
    return margin


def checkpoint_name(folder, name):
    """A parameter's name as save_pretrained wrote it: transformers 5 keeps some multimodal checkpoints in
    their released layout (Gemma 3: language_model.model.* for the in-memory model.language_model.*)."""
    names = load_file(os.path.join(folder, "model.safetensors")).keys()
    if name.startswith("model.language_model.") and "language_model.model.embed_tokens.weight" in names:
        return "language_model.model." + name[len("model.language_model."):]
    return name


def slow_deltanet_decay(model):
    """Gated DeltaNet heads (linear_attn.A_log) with exp(A_log) in [1e-3, 3e-3]: their per-token decay
    exp(-exp(A_log)·softplus(a + dt_bias)) stays above 0.99, so their state lasts the whole document
    (transformers draws exp(A_log) from [0.01, 16], whose fast decays forget within a few tokens)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("linear_attn.A_log"):
                p.copy_(torch.empty_like(p).uniform_(1e-3, 3e-3).log())


def add_mtp_tensors(folder, hidden):
    """Multi-token-prediction tensors as the released checkpoints carry them (transformers ignores ^mtp.*
    on load): appended to model.safetensors for spindle to carry over unchanged."""
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(7)
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen).to(torch.bfloat16)
    tensors["mtp.norm.weight"] = torch.randn(hidden, generator=gen).to(torch.bfloat16)
    tensors["mtp.layers.0.mlp.shared_expert_gate.weight"] = torch.randn(1, hidden, generator=gen).to(torch.bfloat16)
    save_file(tensors, path, metadata={"format": "pt"})


def fuse_experts(folder):
    """Rewrites per-expert routed-expert tensors (what transformers 5's save_pretrained writes) in the layout
    the released Qwen3.5/3.6-MoE checkpoints use: experts.gate_up_proj [E, 2I, H] (each expert's gate rows,
    then its up rows) and experts.down_proj [E, H, I]."""
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    pattern = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    per_layer = {}
    for name in list(tensors):
        m = pattern.match(name)
        if m:
            per_layer.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = tensors.pop(name)
    for prefix, parts in per_layer.items():
        experts = 1 + max(e for e, _ in parts)
        tensors[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate")], parts[(e, "up")]], dim=0) for e in range(experts)]).contiguous()
        tensors[prefix + ".down_proj"] = torch.stack([parts[(e, "down")] for e in range(experts)]).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})


def relative_error(got, ref):
    """||got - ref|| / ||ref|| over the whole tensor, as spindle's tests measure it."""
    ref = ref.double()
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-300))


def bf16_noise(name, config, model_class=None, draws=4):
    """How far a BF16 step may land from the F32 step on these tiny, ill-conditioned models (rounding only
    their weights to BF16 moves some LoRA gradients by 10-30 %): per gradient tensor, the larger of
    transformers' own BF16 step's error and the largest error of `draws` F32 steps whose weights are
    perturbed by up to half a BF16 ulp (relative ±2^-9, uniform), all against the F32 step on the
    case's weights rounded to BF16. One BF16 run is one draw of that noise; the perturbed steps show its
    spread. Reads the case already in OUT/<name> (model, adapter, data), writes OUT/<name>/bf16_noise.json,
    which the GPU model test holds spindle's BF16 step to (tests/cuda/test_cuda_model.cpp)."""
    folder = os.path.join(OUT, name)
    docs = [json.loads(line) for line in open(os.path.join(folder, "data.jsonl"))]
    cls = model_class or transformers.AutoModelForCausalLM
    model = cls.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32)
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith("model.visual."))
    if os.path.exists(os.path.join(folder, "adapter")):
        import peft
        model = peft.PeftModel.from_pretrained(model, os.path.join(folder, "adapter"), is_trainable=True)
    model.eval()
    with torch.no_grad():  # the F32 reference holds exactly the weights a BF16 model holds
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    trainable = [(n.replace(".default", ""), p) for n, p in model.named_parameters() if p.requires_grad]
    moe = getattr(config, "model_type", "") in MOE_TYPES
    aux_on = moe and bool(getattr(text_config(config), "output_router_logits", False))
    run = (lambda m: reference_moe(m, docs, trainable, config)) if aux_on else (lambda m: reference(m, docs, trainable))

    def errors(out, ref):
        per = {n: relative_error(out["grad." + n], ref["grad." + n]) for n, _ in trainable}
        every = relative_error(torch.cat([out["grad." + n].flatten() for n, _ in trainable]),
                               torch.cat([ref["grad." + n].flatten() for n, _ in trainable]))
        return per, every

    f32, loss32 = run(model)
    rounded = [p.detach().clone() for p in model.parameters()]
    perturbed = {n: 0.0 for n, _ in trainable}
    for draw in range(draws):
        gen = torch.Generator().manual_seed(draw)
        with torch.no_grad():
            for p, w in zip(model.parameters(), rounded):
                p.copy_(w * (1 + (torch.rand(w.shape, generator=gen) - 0.5) * 2.0 ** -8))
        per, _ = errors(run(model)[0], f32)
        perturbed = {n: max(perturbed[n], e) for n, e in per.items()}
    with torch.no_grad():
        for p, w in zip(model.parameters(), rounded):
            p.copy_(w)
    model.to(torch.bfloat16)
    bf16, loss16 = run(model)
    hf, every = errors(bf16, f32)
    band = {n: max(hf[n], perturbed[n]) for n in hf}
    summary = {"what": "gradients' relative error ||g - g_f32|| / ||g_f32|| against transformers' F32 step on the "
                       "case's weights rounded to BF16, on the CPU: relative_error_all and relative_error of "
                       "transformers' BF16 step, perturbed_max of F32 steps on weights moved by up to half a "
                       f"BF16 ulp ({draws} draws), band the larger of the two",
               "transformers": transformers.__version__, "torch": torch.__version__,
               "loss_f32": loss32, "loss_bf16": loss16, "relative_error_all": every,
               "relative_error": hf, "perturbed_max": perturbed, "band": band}
    json.dump(summary, open(os.path.join(folder, "bf16_noise.json"), "w"), indent=1)
    worst = max(hf, key=hf.get)
    print(f"{name}: BF16 loss {loss16:.6f} vs F32 {loss32:.6f}; all gradients {every:.4f}, per tensor median "
          f"{sorted(hf.values())[len(hf) // 2]:.4f}, worst {hf[worst]:.4f} ({worst}); band median "
          f"{sorted(band.values())[len(band) // 2]:.4f}")


def write_case(name, config, legacy_rope=None, lora=None, model_class=None):
    if ONLY is not None and name not in ONLY:
        return
    if ARGS.bf16_noise:
        bf16_noise(name, config, model_class)
        return
    seed = zlib.crc32(name.encode())
    rng = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if model_class is not None:  # a multimodal checkpoint (AutoModelForCausalLM may pick its text-only class)
        model = model_class._from_config(config, attn_implementation="eager").float()
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    slow_deltanet_decay(model)
    # Norm weights are ones at init: randomize them so their gradients and scaling are exercised.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "bias" in n:
                p.copy_(0.1 * torch.randn_like(p))
            elif n.endswith("self_attn.sinks"):  # gpt_oss: a visible share of every softmax row
                p.copy_(torch.randn_like(p))
    moe = getattr(config, "model_type", "") in MOE_TYPES
    # The load-balancing loss as the config asks for it (spindle adds it when output_router_logits is set).
    aux_on = moe and bool(getattr(text_config(config), "output_router_logits", False))
    docs = documents(rng)
    notes = {}
    if getattr(config, "model_type", "") == "gpt_oss":
        notes["gate_up_values_past_the_limit"] = gpt_oss_experts_past_the_limit(model, docs)
    glm4 = getattr(config, "model_type", "") == "glm4_moe"
    if glm4:
        model.eval()
        notes.update(make_glm4_routers_decisive(model, docs, seed))
    elif moe:
        model.eval()  # routing as the reference computes it (no training-mode router noise)
        notes["smallest_router_margin"] = make_routers_decisive(model, docs, text_config(config), seed)
    folder = os.path.join(OUT, name)
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    multimodal = any(n.startswith("model.visual.") for n, _ in model.named_parameters())
    if multimodal:
        add_mtp_tensors(folder, text_config(config).hidden_size)
        fuse_experts(folder)  # the released layout; the text-only case keeps transformers' per-expert one
    if glm4 and getattr(config, "num_nextn_predict_layers", 0):
        add_glm4_mtp_layer(folder, config)
    if moe:
        notes["expert_layout"] = expert_layout(folder)
    if moe and not glm4:  # transformers defines no aux loss for glm4_moe
        try:
            notes.update(hf_aux_loss_note(model, docs, config))
        except Exception as e:  # informative only: the references do not depend on it
            notes["hf_aux_loss_note_error"] = repr(e)[:300]
        print(f"  {notes}")
    if legacy_rope is not None:
        # Rewrite the rope settings in the transformers-4 spelling, so both spellings are tested.
        path = os.path.join(folder, "config.json")
        cfg = json.load(open(path))
        cfg.pop("rope_parameters", None)
        cfg.update(legacy_rope)
        json.dump(cfg, open(path, "w"), indent=2)

    # The vision tower is not spindle's to train: frozen, and no gradient of it is a reference.
    for n, p in model.named_parameters():
        if n.startswith(VISION_PREFIXES):
            p.requires_grad_(False)
    trainable = [(checkpoint_name(folder, n), p) for n, p in model.named_parameters()
                 if not n.startswith(VISION_PREFIXES)]
    if lora is not None:
        import peft

        lora = dict(lora)
        lora_std = lora.pop("init_std", 0.3)  # of every A and B entry
        if glm4 and "target_parameters" not in lora:
            with PeftModuleTargetsAsWritten():
                model = peft.get_peft_model(model, peft.LoraConfig(**lora))
            notes["peft_moe_target_rewrite_bypassed"] = True
        else:
            model = peft.get_peft_model(model, peft.LoraConfig(**lora))
        if moe and "target_parameters" not in lora and any(".mlp.experts." in n for n, _ in model.named_parameters()
                                                            if "lora_" in n):
            # Per-expert modules matched the MLP names: adapt the attention only (spindle adapts no expert).
            lora = dict(lora, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
            model = peft.get_peft_model(model.unload(), peft.LoraConfig(**lora))
            notes["lora_targets_narrowed"] = True
        for attempt in range(200):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n or "lora_A" in n:
                        p.copy_(lora_std * torch.randn_like(p))
            # The adapters move the routers' inputs: their decisions must stay clear of ties too.
            if not moe:
                break
            if glm4:
                notes.update(glm4_routing_report(model, docs))
                if notes["smallest_router_margin"] > GLM4_MARGIN:
                    break
                continue
            notes["smallest_router_margin"] = router_margin(model, docs, text_config(config).num_experts_per_tok)
            if getattr(config, "model_type", "") == "gpt_oss":  # and the experts' values clear of the clamps
                notes["smallest_clamp_margin"] = clamp_margin(model, docs)
                if notes["smallest_clamp_margin"] <= CLAMP_MARGIN:
                    continue
            if notes["smallest_router_margin"] > ROUTER_MARGIN:
                break
        else:
            raise SystemExit(f"{name}: no LoRA draw keeps the routers decisive")
        model.save_pretrained(os.path.join(folder, "adapter"))
        # Gradient names as the adapter file spells them (no adapter name).
        trainable = [(n.replace(".default", ""), p) for n, p in model.named_parameters() if p.requires_grad]
    model.eval()  # no dropout; LoRA dropout is 0 anyway

    with open(os.path.join(folder, "data.jsonl"), "w") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    rope_tables = RopeTablesPerDocument(model) if length_dependent_rope(config) else None
    tensors, loss = reference_moe(model, docs, trainable, config) if aux_on else reference(model, docs, trainable)
    if rope_tables is not None:
        notes.update(rope_tables.verify(docs))
        print(f"  {notes}")
    save_file(tensors, os.path.join(folder, "expected.safetensors"))
    summary = {"loss": loss, "num_items": int(tensors["num_items"][0]), "transformers": transformers.__version__,
               "torch": torch.__version__, "trainable": [n for n, _ in trainable]}
    if notes and not moe:
        summary.update(notes)
    if moe:
        import peft
        summary.update(peft=peft.__version__, **notes)
        if aux_on:
            summary["aux_loss"] = float(tensors["aux_loss"][0])
    json.dump(summary, open(os.path.join(folder, "expected.json"), "w"), indent=1)
    print(f"{name}: loss {loss:.8f} num_items {int(tensors['num_items'][0])} tensors {len(tensors)}")


def main():
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    llama = transformers.LlamaConfig(**common, tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    write_case("llama", llama, legacy_rope={
        "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}})
    qwen2 = transformers.Qwen2Config(**common, tie_word_embeddings=True,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    write_case("qwen2", qwen2)
    qwen3 = transformers.Qwen3Config(**{**common, "hidden_size": 48}, head_dim=16, tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0})
    write_case("qwen3", qwen3)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    write_case("qwen2_lora", qwen2, lora=dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    write_case("llama_rslora", llama, legacy_rope={
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}},
               lora=dict(r=8, lora_alpha=4, lora_dropout=0.0, use_rslora=True,
                         target_modules=["q_proj", "v_proj", "down_proj"]))

    # mistral: every layer a sliding window of 5 keys, shorter than the documents of 9, 12, 17 and 23
    # tokens (a packed row must cut each query's keys at the window and at its document's start);
    # explicit head_dim (as Mistral-Small and Devstral set it); LoRA with nonzero B on every projection.
    mistral = transformers.MistralConfig(**common, head_dim=24, sliding_window=5, tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    write_case("mistral", mistral)
    write_case("mistral_lora", mistral, lora=dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    # qwen3 with YaRN (factor 4 over an original window of 8, so the documents of 9-23 tokens run past it;
    # untruncated bounds and mscale/mscale_all_dim, as gpt-oss and DeepSeek-style configs set them), in
    # the v4 spelling with a factor that is not the ratio of the windows (the explicit factor wins).
    qwen3_yarn = transformers.Qwen3Config(**{**common, "hidden_size": 48}, head_dim=16, tie_word_embeddings=False,
                                          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                           "original_max_position_embeddings": 8,
                                                           "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False,
                                                           "mscale": 1.0, "mscale_all_dim": 0.5})
    write_case("qwen3_yarn", qwen3_yarn, legacy_rope={
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 8.0,
                         "beta_slow": 1.0, "truncate": False, "mscale": 1.0, "mscale_all_dim": 0.5}})
    # YaRN with its defaults (truncated bounds, attention factor 0.1·ln(factor) + 1), v5 spelling.
    llama_yarn = transformers.LlamaConfig(**common, tie_word_embeddings=True,
                                          rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                                           "original_max_position_embeddings": 16})
    write_case("llama_yarn", llama_yarn)

    # gemma2: sliding (window 5) then full layers, attention logits soft-capped (a cap small enough to
    # bend the tiny model's logits) and scaled by query_pre_attn_scalar^-0.5 (not head_dim's), four
    # (1 + w) norms per layer, GeGLU with GELU-tanh, embeddings times √hidden, the final logits
    # soft-capped, tied head. gemma3_text: q/k norms, a 1:1 pattern of sliding and full layers with
    # their own RoPE (the full layers' linearly scaled), no soft-caps.
    gemma_common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
                        query_pre_attn_scalar=24, sliding_window=5, hidden_activation="gelu_pytorch_tanh")
    def gemma2():
        return transformers.Gemma2Config(**gemma_common, num_hidden_layers=2, attn_logit_softcapping=1.5,
                                         final_logit_softcapping=2.0,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

    def gemma3_text():
        return transformers.Gemma3TextConfig(
            **gemma_common, num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})

    # gemma3: the multimodal checkpoint (Gemma3ForConditionalGeneration) around gemma3_text's layers, a tiny
    # SigLIP tower and projector that text-only training never runs; its text model under
    # model.language_model., a tied head.
    def gemma3():
        vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=16, patch_size=4)
        return transformers.Gemma3Config(text_config=gemma3_text().to_dict(), vision_config=vision.to_dict(),
                                         mm_tokens_per_image=4, image_token_index=VOCAB - 1,
                                         boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 3)

    for case, make, lora, model_class in (
            ("gemma2", gemma2, None, None),
            ("gemma2_lora", gemma2, dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets), None),
            ("gemma3_text", gemma3_text, None, None),
            ("gemma3", gemma3, None, transformers.Gemma3ForConditionalGeneration)):
        try:  # one family's API change must not cost the other cases
            write_case(case, make(), lora=lora, model_class=model_class)
        except Exception as e:
            print(f"{case}: FAILED {e!r}")

    # qwen3_moe: layers 0 and 2 MoE (top-2 of 4 experts, renormalised), layer 1 dense (mlp_only_layers);
    # the load-balancing loss on, with a coefficient large enough to show in every gradient.
    qwen3_moe = transformers.Qwen3MoeConfig(**{**common, "hidden_size": 48, "num_hidden_layers": 3}, head_dim=16,
                                            tie_word_embeddings=False, moe_intermediate_size=32, num_experts=4,
                                            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                            mlp_only_layers=[1], output_router_logits=True, router_aux_loss_coef=0.1,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    write_case("qwen3_moe", qwen3_moe)
    write_case("qwen3_moe_lora", qwen3_moe, lora=dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    # PEFT's LoRA on the fused expert tensors (target_parameters; peft >= 0.17), the base saved per expert
    # as transformers 5 writes it: per expert e, gate_up_proj[e] + s·B_e·A_e and down_proj[e] + s·B_e·A_e.
    write_case("qwen3_moe_expert_lora", qwen3_moe,
               lora=dict(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["q_proj"],
                         target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))

    # qwen3_5, text-only (Qwen3_5ForCausalLM): gated DeltaNet, gated attention, gated DeltaNet; two value
    # heads per key head of another width; attention heads of 16 with RoPE on their first 4 dims.
    qwen3_5 = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                   rms_norm_eps=1e-5, layer_types=["linear_attention", "full_attention", "linear_attention"],
                   linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                   linear_conv_kernel_dim=4,
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    write_case("qwen3_5", transformers.Qwen3_5TextConfig(**qwen3_5, tie_word_embeddings=False))
    write_case("qwen3_5_lora", transformers.Qwen3_5TextConfig(**qwen3_5, tie_word_embeddings=True),
               # Adapters of std 0.1: at 0.3 they saturate β = σ(b) on some tokens, and the F32 gradients
               # then carry rounding of 1e-4 relative (F32 against F64 in spindle), the parity tolerance.
               lora=dict(r=4, lora_alpha=8, lora_dropout=0.0, init_std=0.1,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                                         "in_proj_b", "in_proj_a", "out_proj", "gate_proj", "up_proj", "down_proj"]))

    # qwen3_5_moe (Qwen3.5-MoE / Qwen3.6): qwen3_5's three layers, each feed-forward routed experts (top-2 of 4,
    # always renormalised, fused as the released checkpoints store them) plus a shared expert behind its
    # sigmoid gate. The multimodal checkpoint with a tiny vision tower, the load-balancing loss on; its LoRA
    # case (aux off) on the attention, DeltaNet, shared-expert and gate projections with nonzero B; and the
    # text-only Qwen3_5MoeForCausalLM.
    moe_text = {k: v for k, v in qwen3_5.items() if k != "intermediate_size"}
    moe_text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                    output_router_logits=True, router_aux_loss_coef=0.1,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                     "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=4,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)

    def qwen3_5_moe_config(**text_overrides):
        return transformers.Qwen3_5MoeConfig(text_config={**moe_text, **text_overrides}, vision_config=vision,
                                             tie_word_embeddings=False, image_token_id=VOCAB - 4,
                                             video_token_id=VOCAB - 3, vision_start_token_id=VOCAB - 2,
                                             vision_end_token_id=VOCAB - 1)

    multimodal = transformers.Qwen3_5MoeForConditionalGeneration
    write_case("qwen3_5_moe", qwen3_5_moe_config(), model_class=multimodal)
    write_case("qwen3_5_moe_lora", qwen3_5_moe_config(output_router_logits=False), model_class=multimodal,
               lora=dict(r=4, lora_alpha=8, lora_dropout=0.0, init_std=0.1,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                                         "out_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate"]))
    write_case("qwen3_5_moe_text", transformers.Qwen3_5MoeTextConfig(**moe_text, tie_word_embeddings=False))
    # qwen3_next: qwen3_5's three layers with the DeltaNet projections fused per key head (in_proj_qkvz,
    # in_proj_ba; two value heads per key head), the middle layer dense (mlp_only_layers), the others
    # routed experts plus the gated shared expert. The full case renormalises no top-k (norm_topk_prob off)
    # with the load-balancing loss on; its LoRA case (aux off, norm_topk_prob on, as released) adapts the
    # fused projections, attention and the shared expert's gate with nonzero B.
    next_text = dict(moe_text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                 "partial_rotary_factor": 0.25},
                     intermediate_size=40, decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=False)
    write_case("qwen3_next", transformers.Qwen3NextConfig(**next_text, norm_topk_prob=False))
    write_case("qwen3_next_lora", transformers.Qwen3NextConfig(**dict(next_text, output_router_logits=False),
                                                               norm_topk_prob=True),
               # No *_proj of the MLPs: PEFT 0.21 maps those names onto the routed experts' fused tensors.
               lora=dict(r=4, lora_alpha=8, lora_dropout=0.0, init_std=0.1,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba",
                                         "out_proj", "shared_expert_gate"]))
    # PEFT's LoRA on the multimodal model's fused routed experts (target_parameters) and its gated attention,
    # the load-balancing loss on: the adapter's tensors under model.language_model., the base's experts fused.
    write_case("qwen3_5_moe_expert_lora", qwen3_5_moe_config(), model_class=multimodal,
               lora=dict(r=4, lora_alpha=8, lora_dropout=0.0, init_std=0.1,
                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                         target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))

    # gpt_oss: a sliding layer (window 8, shorter than most documents) then a full one, sinks on both, biased
    # q/k/v/o; YaRN (untruncated, as the released configs) with an original window of 16 that the longer
    # documents pass; top-2 of 4 biased experts with the clamped SwiGLU, the load-balancing loss on. Its
    # LoRA case adapts the attention projections (spindle refuses LoRA on these experts).
    gpt_oss = transformers.GptOssConfig(
        **{**common, "intermediate_size": 32}, head_dim=16, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"], sliding_window=8, attention_bias=True,
        num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})
    write_case("gpt_oss", gpt_oss)
    write_case("gpt_oss_lora", gpt_oss,
               lora=dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))

    # glm4_moe: 3 layers, the first dense (first_k_dense_replace 1, intermediate_size 96), the others 8 experts
    # of width 16 in 4 groups of 2, 3 per token from the best 2 groups (the sigmoid router, correction biases
    # that change the choice, renormalised, routed_scaling_factor 2.5), 2 shared experts (width 32, ungated);
    # q/k/v biases, q/k norms, RoPE on half of each head (v5 spelling). Its LoRA cases: every projection
    # (attention, the dense MLP, the shared experts) with nonzero B; q_proj and the routed experts' fused
    # tensors (PEFT's target_parameters). glm4_moe_v4: one group, raw scores (norm_topk_prob off), no q/k
    # norm or attention bias, the transformers-4 RoPE spelling and an MTP layer in the checkpoint.
    glm4 = dict(**{**common, "num_hidden_layers": 3}, head_dim=16, tie_word_embeddings=False,
                first_k_dense_replace=1, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3,
                n_shared_experts=2, num_nextn_predict_layers=0)
    glm4_grouped = transformers.Glm4MoeConfig(
        **glm4, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, use_qk_norm=True,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    write_case("glm4_moe", glm4_grouped)
    write_case("glm4_moe_lora", glm4_grouped, lora=dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    write_case("glm4_moe_expert_lora", glm4_grouped,
               lora=dict(r=2, lora_alpha=4, lora_dropout=0.0, init_std=0.1, target_modules=["q_proj"],
                         target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    glm4_v4 = transformers.Glm4MoeConfig(
        **{**glm4, "num_nextn_predict_layers": 1}, n_group=1, topk_group=1, norm_topk_prob=False,
        routed_scaling_factor=1.8, use_qk_norm=False, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5})
    write_case("glm4_moe_v4", glm4_v4,
               legacy_rope={"rope_theta": 1000000.0, "rope_scaling": None, "partial_rotary_factor": 0.5})


    # phi3 (Phi-3, Phi-3.5/4-mini): q, k and v in one projection (qkv_proj), gate and up in one (gate_up_proj),
    # LongRoPE. transformers picks the short or the long factors in every forward from max(position_ids) + 1,
    # here one document at a time: with an original window of 8 the documents of 9, 12, 17 and 23 tokens
    # rotate with the long factors and those of 1, 4 and 5 with the short ones (RopeTablesPerDocument checks
    # it); the attention factor (√(1 + ln(512/8)/ln 8) = √3 from max/original, or from an explicit factor)
    # scales cos and sin in both. phi3: a sliding window of 6 on every layer, the v4 spelling Phi-3 checkpoints
    # ship (rope_scaling "longrope", rope_theta and original_max_position_embeddings at the top level).
    # phi3_lora: Phi-4-mini's shape (RoPE on 0.75 of each head: 6 factors per list, a tied head), an
    # explicit factor, the v5 spelling, LoRA with nonzero B on the fused projections (one A and one B each,
    # as PEFT adapts an nn.Linear; std 0.1, at which a BF16 step moves the gradients by 1 %, against 120 %
    # at 0.3). phi3_short: an original window of 64, past every document, so only the
    # short factors rotate; an explicit attention_factor; partial_rotary_factor at the top level (v4).
    factor_rng = torch.Generator().manual_seed(32)

    def factors(n, low, high):
        """n factors growing from about `low` to `high` (LongRoPE's lists rise with the pair index), jittered."""
        ramp = torch.linspace(low, high, n) * (1 + 0.1 * torch.rand(n, generator=factor_rng))
        return [round(float(x), 4) for x in ramp]

    phi3_common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                       bos_token_id=1, eos_token_id=2, pad_token_id=None)  # Phi3Config: 32000, past this vocabulary
    short8, long8 = factors(8, 1.0, 1.3), factors(8, 1.0, 12.0)
    short6, long6 = factors(6, 1.0, 1.3), factors(6, 1.0, 12.0)

    def phi3():
        return transformers.Phi3Config(**phi3_common, original_max_position_embeddings=8, sliding_window=6,
                                       tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                        "short_factor": short8, "long_factor": long8})

    def phi3_partial():
        return transformers.Phi3Config(**phi3_common, original_max_position_embeddings=8, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0,
                                                        "partial_rotary_factor": 0.75, "short_factor": short6,
                                                        "long_factor": long6})

    def phi3_short():
        return transformers.Phi3Config(**phi3_common, original_max_position_embeddings=64, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                        "attention_factor": 1.3, "partial_rotary_factor": 0.75,
                                                        "short_factor": short6, "long_factor": long6})

    phi3_targets = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    for case, make, legacy, lora in (
            ("phi3", phi3, {"rope_theta": 10000.0, "rope_scaling": {"type": "longrope", "short_factor": short8,
                                                                    "long_factor": long8}}, None),
            ("phi3_lora", phi3_partial, None, dict(r=4, lora_alpha=8, lora_dropout=0.0, init_std=0.1,
                                                   target_modules=phi3_targets)),
            ("phi3_short", phi3_short, {"rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                        "rope_scaling": {"type": "longrope", "attention_factor": 1.3,
                                                         "short_factor": short6, "long_factor": long6}}, None)):
        try:
            write_case(case, make(), legacy_rope=legacy, lora=lora)
        except Exception as e:
            print(f"{case}: FAILED {e!r}")

    # Dynamic NTK on llama, max_position_embeddings 8: the documents of 9, 12, 17 and 23 tokens grow the base
    # to their own lengths, the others keep it (RopeTablesPerDocument checks that transformers' state, which
    # keeps the longest length until a sequence shorter than 8, never came into play in this order); the v4
    # spelling with "type".
    llama_dynamic = transformers.LlamaConfig(**{**common, "max_position_embeddings": 8}, tie_word_embeddings=False,
                                             rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                              "factor": 2.0})
    write_case("llama_dynamic", llama_dynamic,
               legacy_rope={"rope_theta": 10000.0, "rope_scaling": {"type": "dynamic", "factor": 2.0}})


if __name__ == "__main__":
    main()
