#!/usr/bin/env python3
"""Makes the reference of the preference losses without a reference model (CPO, SimPO, CPO-SimPO,
ORPO) that tests/dpo/test_hf_dpo.cpp checks spindle's preference step against.

Runs on the CPU with torch, transformers, peft and trl (no GPU, no network). It reads the tiny Qwen2,
its LoRA adapter and the four pre-tokenized pairs that scripts/gpu/dpo_reference.py wrote into
DIR (testdata/dpo), and computes each loss as TRL's trainers do:
  - the concatenated forward of trl/experimental/cpo/cpo_trainer.py and orpo/orpo_trainer.py: the
    chosen sequences (prompt + chosen) then the rejected ones, right-padded, one forward with their
    attention mask; log-probabilities by the trainers' own get_batch_logps (summed, or averaged over
    the response tokens for simpo and orpo);
  - the NLL term as their cross-entropy over the chosen rows: the response tokens for CPO, every
    token of prompt and response for ORPO ("orpo chosen nll loss is computed over the full prompt
    and response");
  - the losses by trl's own CPOTrainer.cpo_loss and ORPOTrainer.odds_ratio_loss, called with the
    options below; loss = losses.mean() + cpo_alpha * nll (CPO) or nll - losses.mean() (ORPO).
The model computes in float64: ORPO's gradient is a difference of its NLL's and its odds-ratio term's,
whose fp32 rounding alone moves some LoRA gradients by 2e-4 relative, more than the 1e-4 the test
allows (CPO's and SimPO's by 5e-5). TRL's odds_ratio_loss rounds the averaged log-probabilities to
fp32 for the log odds itself (its `.float()`), which moves nothing by more than 1e-7.

Writes into DIR:
  expected_reference_free.json   per variant: options, loss, nll_loss, per-pair sums and token counts,
                                 the scores the loss compares, rewards, margins, accuracy, log odds
                                 (orpo), per-parameter gradient norms, and the library versions
  expected_<variant>.safetensors grad.<adapter tensor name> (F32) for every LoRA tensor

Usage: python3 scripts/gpu/preference_reference.py [DIR]   (default testdata/dpo)
"""
import json
import math
import os
import sys
from types import SimpleNamespace

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # the trainers live in trl.experimental

import peft
import torch
import transformers
import trl
from safetensors.torch import save_file
from trl.experimental.cpo.cpo_trainer import CPOTrainer
from trl.experimental.orpo.orpo_trainer import ORPOTrainer

torch.use_deterministic_algorithms(True)
DIR = sys.argv[1] if len(sys.argv) > 1 else "testdata/dpo"
PAD = 0

# TRL's names: CPOTrainer's loss_type "sigmoid" is CPO, "simpo" with cpo_alpha 0 SimPO and with
# cpo_alpha > 0 CPO-SimPO; ORPOTrainer's beta is the paper's λ.
VARIANTS = {
    "cpo": dict(trainer="cpo", loss_type="sigmoid", beta=0.3, label_smoothing=0.0, cpo_alpha=1.0, simpo_gamma=0.5),
    "simpo": dict(trainer="cpo", loss_type="simpo", beta=1.5, label_smoothing=0.0, cpo_alpha=0.0, simpo_gamma=0.6),
    "cpo_simpo": dict(trainer="cpo", loss_type="simpo", beta=1.2, label_smoothing=0.1, cpo_alpha=0.5,
                      simpo_gamma=0.4),
    "orpo": dict(trainer="orpo", loss_type="orpo", beta=0.25, label_smoothing=0.0, cpo_alpha=0.0, simpo_gamma=0.0),
}


def concatenated_batch(pairs):
    """The chosen rows, then the rejected rows: input ids, attention mask, and labels with the prompt
    (and padding) at -100, right-padded to the longest."""
    rows = [(p["prompt_input_ids"], p["chosen_input_ids"]) for p in pairs]
    rows += [(p["prompt_input_ids"], p["rejected_input_ids"]) for p in pairs]
    length = max(len(prompt) + len(response) for prompt, response in rows)
    ids, mask, labels = [], [], []
    for prompt, response in rows:
        seq = prompt + response
        pad = length - len(seq)
        ids.append(seq + [PAD] * pad)
        mask.append([1] * len(seq) + [0] * pad)
        labels.append([-100] * len(prompt) + response + [-100] * pad)
    return torch.tensor(ids), torch.tensor(mask), torch.tensor(labels)


def cross_entropy(logits, labels):
    """The trainers' cross_entropy_loss: shifted, a token mean over every label that is not -100."""
    logits = logits[..., :-1, :].contiguous()
    labels = labels[..., 1:].contiguous()
    return torch.nn.CrossEntropyLoss()(logits.view(-1, logits.shape[-1]), labels.view(-1))


def main():
    base = transformers.AutoModelForCausalLM.from_pretrained(DIR, attn_implementation="eager",
                                                             dtype=torch.float64)
    model = peft.PeftModel.from_pretrained(base, os.path.join(DIR, "adapter"), is_trainable=True)
    model.eval()
    trainable = [(n.replace(".default", ""), p) for n, p in model.named_parameters() if p.requires_grad]
    pairs = [json.loads(line) for line in open(os.path.join(DIR, "pairs.jsonl"))]
    n_pairs = len(pairs)
    ids, mask, labels = concatenated_batch(pairs)
    device = SimpleNamespace(device=torch.device("cpu"))

    expected = {"transformers": transformers.__version__, "torch": torch.__version__, "peft": peft.__version__,
                "trl": trl.__version__, "variants": {}}
    for name, o in VARIANTS.items():
        model.zero_grad(set_to_none=True)
        logits = model(ids, attention_mask=mask, use_cache=False).logits
        average = o["loss_type"] in ("simpo", "orpo")
        trainer = CPOTrainer if o["trainer"] == "cpo" else ORPOTrainer
        scores = trainer.get_batch_logps(logits, labels, average_log_prob=average, is_encoder_decoder=False)
        sums = trainer.get_batch_logps(logits, labels, average_log_prob=False, is_encoder_decoder=False)
        chosen, rejected = scores[:n_pairs], scores[n_pairs:]
        extra = {}
        if o["trainer"] == "cpo":
            nll = cross_entropy(logits[:n_pairs], labels[:n_pairs])
            self = SimpleNamespace(alpha=0.0, beta=o["beta"], loss_type=o["loss_type"], simpo_gamma=o["simpo_gamma"],
                                   label_smoothing=o["label_smoothing"], accelerator=device)
            losses, rewards_c, rewards_r = CPOTrainer.cpo_loss(self, chosen, rejected)
            loss = losses.mean() + o["cpo_alpha"] * nll
            nll_labels = labels[:n_pairs]
        else:
            full = torch.where(mask == 1, ids, -100)  # every token of prompt and response
            nll = cross_entropy(logits[:n_pairs], full[:n_pairs])
            self = SimpleNamespace(beta=o["beta"], accelerator=device)
            losses, rewards_c, rewards_r, log_odds_ratio, log_odds_chosen = ORPOTrainer.odds_ratio_loss(
                self, chosen, rejected)
            loss = nll - losses.mean()
            nll_labels = full[:n_pairs]
            extra = {"log_odds_ratio": float(log_odds_ratio.detach()), "log_odds_chosen": float(log_odds_chosen.detach())}
        loss.backward()
        grads = {"grad." + n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().contiguous()
                 for n, p in trainable}
        save_file(grads, os.path.join(DIR, f"expected_{name}.safetensors"))
        tokens = (labels[:, 1:] != -100).sum(dim=1)
        options = {k: v for k, v in o.items() if k != "trainer"}
        expected["variants"][name] = {
            "options": options,
            "loss": float(loss.detach()),
            "nll_loss": float(nll.detach()),
            "nll_tokens": int((nll_labels[:, 1:] != -100).sum()),
            "policy_chosen": sums[:n_pairs].detach().tolist(), "policy_rejected": sums[n_pairs:].detach().tolist(),
            "tokens_chosen": tokens[:n_pairs].tolist(), "tokens_rejected": tokens[n_pairs:].tolist(),
            "logps_chosen": chosen.detach().tolist(), "logps_rejected": rejected.detach().tolist(),
            "rewards_chosen": rewards_c.double().tolist(), "rewards_rejected": rewards_r.double().tolist(),
            "margins": float((rewards_c - rewards_r).double().mean()),
            "accuracy": float((rewards_c > rewards_r).double().mean()),
            "grad_norms": {n: float(g.double().norm()) for n, g in grads.items()},
            **extra,
        }
        v = expected["variants"][name]
        print(f"{name}: loss {v['loss']:.10f} nll {v['nll_loss']:.6f} margins {v['margins']:.6f} "
              f"accuracy {v['accuracy']:.2f} "
              f"|grad| {math.sqrt(sum(g ** 2 for g in v['grad_norms'].values())):.6e}")
    json.dump(expected, open(os.path.join(DIR, "expected_reference_free.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
