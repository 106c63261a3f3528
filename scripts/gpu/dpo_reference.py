#!/usr/bin/env python3
"""Makes the DPO reference that tests/dpo/test_hf_dpo.cpp checks spindle's preference step against.

Runs where torch, transformers and peft are installed (the GPU host, no network needed). It computes on
the CPU in fp32 (float64 for the loss arithmetic) so no TF32 or kernel choice blurs the reference.
Writes into OUT_DIR:
  config.json, model.safetensors   a tiny random Qwen2 model as transformers saves it (the base / reference)
  adapter/                         a PEFT LoRA adapter on every projection, A and B random (policy != reference)
  pairs.jsonl                      pre-tokenized pairs, TRL's field names: prompt_input_ids, chosen_input_ids,
                                   rejected_input_ids (the response ids follow the prompt; only they are scored)
  expected.json                    per variant: options, loss, nll, per-pair policy/reference log-prob sums and
                                   token counts, rewards, margins, accuracy, per-parameter gradient norms
  expected_<variant>.safetensors   grad.<adapter tensor name> (F32) for every LoRA tensor
The reference log-probabilities come from the same PeftModel with the adapter disabled (TRL's default for a
PEFT policy without ref_model). The loss is TRL's DPOTrainer loss (trl/trainer/dpo_trainer.py):
  sigmoid  -(1-eps)*logsigmoid(beta*h) - eps*logsigmoid(-beta*h),   h = (pi_c - ref_c) - (pi_r - ref_r)
  ipo      (h_avg - 1/(2*beta))**2, log-ratios averaged over each response's completion tokens
  rpo      + rpo_alpha * cross-entropy over the chosen completion tokens of the batch (a token mean)
averaged over the pairs of the batch. Log-probabilities are summed over completion tokens, computed from
full logits (log_softmax + gather), one sequence per forward without padding.

Usage: python3 scripts/gpu/dpo_reference.py OUT_DIR
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

torch.use_deterministic_algorithms(True)
OUT = sys.argv[1] if len(sys.argv) > 1 else "testdata/dpo"
VOCAB = 96

VARIANTS = {
    "sigmoid": dict(loss_type="sigmoid", beta=0.5, label_smoothing=0.0, rpo_alpha=0.0),
    "label_smoothing": dict(loss_type="sigmoid", beta=0.8, label_smoothing=0.15, rpo_alpha=0.0),
    "ipo": dict(loss_type="ipo", beta=0.3, label_smoothing=0.0, rpo_alpha=0.0),
    "rpo": dict(loss_type="sigmoid", beta=0.4, label_smoothing=0.0, rpo_alpha=0.7),
}


def make_pairs(rng):
    """Prompts and responses of different lengths; chosen and rejected share the prompt."""
    pairs = []
    for prompt_len, chosen_len, rejected_len in [(5, 7, 4), (3, 9, 11), (8, 2, 6), (4, 5, 5)]:
        randint = lambda n: torch.randint(0, VOCAB, (n,), generator=rng).tolist()
        pairs.append({"prompt_input_ids": randint(prompt_len), "chosen_input_ids": randint(chosen_len),
                      "rejected_input_ids": randint(rejected_len)})
    return pairs


def sequence_logp(model, prompt, response):
    """(Σ log p of the response tokens given the prompt, count, Σ CE for RPO): one sequence, no padding."""
    ids = torch.tensor([prompt + response])
    logits = model(input_ids=ids).logits[0].double()  # [L, V]
    logp = torch.log_softmax(logits[:-1], dim=-1)
    targets = ids[0, 1:]
    per_token = logp.gather(1, targets[:, None])[:, 0]
    mask = torch.zeros_like(per_token, dtype=torch.bool)
    mask[len(prompt) - 1:] = True  # position i predicts token i+1: the response starts at len(prompt)
    return per_token[mask].sum(), int(mask.sum())


def dpo_loss(options, pol_c, pol_r, ref_c, ref_r, n_c, n_r):
    beta, eps = options["beta"], options["label_smoothing"]
    if options["loss_type"] == "ipo":
        h = (pol_c - ref_c) / n_c - (pol_r - ref_r) / n_r
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        h = (pol_c - ref_c) - (pol_r - ref_r)
        losses = -F.logsigmoid(beta * h) * (1 - eps) - F.logsigmoid(-beta * h) * eps
    nll = -pol_c.sum() / n_c.sum()
    loss = losses.mean() + (options["rpo_alpha"] * nll if options["rpo_alpha"] > 0 else 0.0)
    return loss, losses, nll


def main():
    import peft

    torch.manual_seed(1234)
    rng = torch.Generator().manual_seed(1234)
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    base = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for n, p in base.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "bias" in n:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.mul_(4.0)  # sharper distributions than the 0.02 init: log-probs differ between tokens
    os.makedirs(OUT, exist_ok=True)
    base.save_pretrained(OUT, safe_serialization=True)

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_A" in n or "lora_B" in n:
                p.copy_(0.4 * torch.randn_like(p))
    model.save_pretrained(os.path.join(OUT, "adapter"))
    model.eval()
    trainable = [(n.replace(".default", ""), p) for n, p in model.named_parameters() if p.requires_grad]

    pairs = make_pairs(rng)
    with open(os.path.join(OUT, "pairs.jsonl"), "w") as f:
        for pair in pairs:
            f.write(json.dumps(pair) + "\n")

    with torch.no_grad(), model.disable_adapter():
        ref = [[sequence_logp(model, p["prompt_input_ids"], p[k])[0] for k in ("chosen_input_ids", "rejected_input_ids")]
               for p in pairs]
    ref_c = torch.stack([r[0] for r in ref]).detach()
    ref_r = torch.stack([r[1] for r in ref]).detach()

    expected = {"transformers": transformers.__version__, "torch": torch.__version__, "peft": peft.__version__,
                "variants": {}}
    for name, options in VARIANTS.items():
        model.zero_grad(set_to_none=True)
        chosen = [sequence_logp(model, p["prompt_input_ids"], p["chosen_input_ids"]) for p in pairs]
        rejected = [sequence_logp(model, p["prompt_input_ids"], p["rejected_input_ids"]) for p in pairs]
        pol_c = torch.stack([c[0] for c in chosen])
        pol_r = torch.stack([r[0] for r in rejected])
        n_c = torch.tensor([float(c[1]) for c in chosen], dtype=torch.float64)
        n_r = torch.tensor([float(r[1]) for r in rejected], dtype=torch.float64)
        loss, losses, nll = dpo_loss(options, pol_c, pol_r, ref_c, ref_r, n_c, n_r)
        loss.backward()
        rewards_c = options["beta"] * (pol_c - ref_c).detach()
        rewards_r = options["beta"] * (pol_r - ref_r).detach()
        grads = {"grad." + n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().contiguous()
                 for n, p in trainable}
        save_file(grads, os.path.join(OUT, f"expected_{name}.safetensors"))
        expected["variants"][name] = {
            "options": options,
            "loss": float(loss),
            "nll_loss": float(nll),
            "per_pair_loss": losses.detach().tolist(),
            "policy_chosen": pol_c.detach().tolist(), "policy_rejected": pol_r.detach().tolist(),
            "reference_chosen": ref_c.tolist(), "reference_rejected": ref_r.tolist(),
            "tokens_chosen": [int(x) for x in n_c], "tokens_rejected": [int(x) for x in n_r],
            "rewards_chosen": rewards_c.tolist(), "rewards_rejected": rewards_r.tolist(),
            "margins": float((rewards_c - rewards_r).mean()),
            "accuracy": float((rewards_c > rewards_r).double().mean()),
            "grad_norms": {n: float(g.double().norm()) for n, g in grads.items()},
        }
        print(f"{name}: loss {float(loss):.10f} margins {expected['variants'][name]['margins']:.6f} "
              f"accuracy {expected['variants'][name]['accuracy']:.2f} "
              f"|grad| {math.sqrt(sum(v ** 2 for v in expected['variants'][name]['grad_norms'].values())):.6e}")
    json.dump(expected, open(os.path.join(OUT, "expected.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
