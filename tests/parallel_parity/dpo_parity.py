#!/usr/bin/env python3
"""`spindle dpo` on real CPU processes against one process (docs/design.md §2, docs/dpo.md).

A tiny GQA Llama (4 query heads, 2 KV heads: Ulysses 4 would replicate KV heads) with the demo's
BPE tokenizer trains for 3 optimizer steps at lr 1e-2 on text preference pairs (a prompt, a chosen
and a rejected answer of different lengths), 2 items (rows of whole pairs) per replica and step.
Every mesh must log the losses, rewards, margins, accuracies, pair and target counts of one
process with the same global batch, within 1e-5 relative (F32; rewards and margins relative to
β·|log-probability sum|, the size of the F32 sums they are differences of: at step 3 a difference
of 2e-5 in a reward of 0.16 is rounding of sums near −30); with new LoRA adapters (B = 0) the
reference equals the policy, so the first step's loss is ln 2 within 1e-6.

Cases: packing on (several pairs share a row, chosen and rejected in the same row) at sp 2
ulysses, sp 2 ring, sp 4 hybrid (u2 x r2) and dp 2; packing off (one pair per row) at sp 2 ring
and dp 2 x sp 2; IPO + RPO at sp 2 ulysses; the reference from --ref-model (FSDP-
sharded, every step, with label smoothing) at sp 2 ring; --precompute-ref at sp 4 against the per-step reference of one
process; --full (the initial model, precomputed) at dp 2 x sp 2 ulysses; a MoE model with the router
load-balancing loss (aux_loss logged and held to the same tolerance) at dp 2 x sp 2 ulysses.

usage: dpo_parity.py SPINDLE ROOT
"""
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from tiny_model import config, qwen3_moe_config, write_model  # noqa: E402

spindle, root = sys.argv[1], sys.argv[2]
work = tempfile.mkdtemp(prefix="spindle-dpo-parity-")
tokenizer_dir = os.path.join(root, "demo", "tokenizer")


def make_pairs(path, seed=3):
    """Text pairs from the demo's capitals: the right capital (chosen) against another (rejected),
    answers of 1 to 3 sentences so responses and rows have many lengths."""
    rng = random.Random(seed)
    facts = []
    for line in open(os.path.join(root, "demo", "capitals.jsonl")):
        m = json.loads(line)["messages"]
        facts.append((m[0]["content"], m[1]["content"]))
    picked = rng.sample(facts, 10)
    with open(path, "w") as f:
        for question, answer in picked:
            wrong = rng.choice([a for _, a in facts if a != answer])
            chosen = " ".join([f"{answer}."] * rng.randint(1, 3))
            rejected = " ".join([f"It is {wrong}."] * rng.randint(1, 2))
            f.write(json.dumps({"prompt": question, "chosen": chosen, "rejected": rejected}) + "\n")


model = os.path.join(work, "model")
write_model(model, config(), tokenizer_dir=tokenizer_dir)
data = os.path.join(work, "pairs.jsonl")
make_pairs(data)
FIELDS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
          "logps/rejected", "nll_loss")
BETA = 0.5


def dpo(name, nproc=1, extra=(), lr="1e-2", policy=None):
    if "--grad-accum" not in extra:
        extra = list(extra) + ["--grad-accum", "2"]
    out = os.path.join(work, name)
    cmd = [spindle, "dpo", "--model", policy or model, "--data", data, "--output", out, "--max-length", "64", "--lr", lr,
           "--max-steps", "3", "--beta", str(BETA), "--lora-rank", "4", "--threads", "1",
           "--log-every", "100", "--nproc-per-node", str(nproc)] + list(extra)
    start = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        print(f"FAIL {name}: {' '.join(cmd)}\n{p.stderr[-3000:]}")
        return None
    lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    print(f"     {name}: {time.time() - start:.1f} s, losses {[round(l['loss'], 6) for l in lines]}")
    return lines


def same(name, got, want, first_is_ln2=True):
    ok = got is not None and want is not None and len(got) == len(want) == 3
    worst, worst_key = 0.0, ""
    if ok:
        for g, w in zip(got, want):
            ok &= g["num_items"] == w["num_items"] and g["pairs"] == w["pairs"] and g["tokens"] == w["tokens"]
            for k in FIELDS + (("aux_loss",) if "aux_loss" in w else ()):
                ok &= k in g
                # Rewards and margins are β·(π − ρ): differences of sums of F32 log-probabilities,
                # so their rounding is relative to the sums' size, not to the difference's.
                scale = BETA * max(abs(w["logps/chosen"]), abs(w["logps/rejected"])) if k.startswith("rewards/") else 0
                err = abs(g[k] - w[k]) / max(abs(w[k]), scale, 1e-3)
                if err > worst:
                    worst, worst_key = err, f"{k} step {g['step']}: {g[k]} vs {w[k]}"
                ok &= err <= 1e-5
        if first_is_ln2:
            ln2_err = abs(got[0]["loss"] - math.log(2))
            ok &= ln2_err <= 1e-6 and got[0]["rewards/accuracies"] == 0
        ok &= got[2]["loss"] != got[0]["loss"]  # it trained
    print(f"{'ok  ' if ok else 'FAIL'} {name}: worst relative difference {worst:.1e} ({worst_key})")
    return ok


results = []
start = time.time()
one = dpo("one")
results.append(same("sp1 (one process) first loss ln 2", one, one))
results.append(same("packing: sp2 ulysses", dpo("sp2u", 2, ["--sp", "2", "--ulysses", "2"]), one))
results.append(same("packing: sp2 ring", dpo("sp2r", 2, ["--sp", "2", "--ring", "2"]), one))
results.append(same("packing: sp4 hybrid u2 x r2", dpo("sp4h", 4, ["--sp", "4", "--ulysses", "2", "--ring", "2"]), one))
# dp 2 draws 2 items per replica: the global batch of one process with 4 items per step.
one4 = dpo("one-accum4", 1, ["--grad-accum", "4"])
results.append(same("packing: dp2", dpo("dp2", 2, ["--dp", "2"]), one4))
one_rows = dpo("one-nopack", 1, ["--no-packing"])
results.append(same("no packing: sp2 ring", dpo("sp2r-nopack", 2, ["--no-packing", "--sp", "2", "--ring", "2"]), one_rows))
results.append(same("no packing: dp2 x sp2 ulysses (replicated weights)",
                    dpo("dp2sp2-nopack", 4, ["--no-packing", "--sp", "2", "--no-fsdp"]),
                    dpo("one-nopack-accum4", 1, ["--no-packing", "--grad-accum", "4"])))
ipo = ["--loss-type", "ipo", "--rpo-alpha", "0.5"]
results.append(same("ipo + rpo: sp2 ulysses", dpo("sp2u-ipo", 2, ipo + ["--sp", "2"]), dpo("one-ipo", 1, ipo),
                    first_is_ln2=False))
ref = ["--ref-model", model, "--label-smoothing", "0.1"]
one_ref = dpo("one-ref", 1, ref)
results.append(same("--ref-model (FSDP-sharded, every step): sp2 ring", dpo("sp2r-ref", 2, ref + ["--sp", "2", "--ring", "2"]),
                    one_ref))
results.append(same("--precompute-ref: sp4 ulysses vs one process computing it every step",
                    dpo("sp4-pre", 4, ["--precompute-ref", "--sp", "4"]), one))
results.append(same("--full (initial model precomputed): dp2 x sp2 ulysses",
                    dpo("dp2sp2-full", 4, ["--full", "--sp", "2"], lr="1e-3"), dpo("one-full", 1, ["--full", "--grad-accum", "4"], lr="1e-3")))
# A MoE model trained with the router load-balancing loss (its config asks for it): the loss's
# statistics are global over the step like the pairs' sums, so every mesh logs one process's aux_loss.
moe = os.path.join(work, "moe")
write_model(moe, qwen3_moe_config(output_router_logits=True, router_aux_loss_coef=0.05), tokenizer_dir=tokenizer_dir)
results.append(same("MoE with the router loss: dp2 x sp2 ulysses",
                    dpo("dp2sp2-moe", 4, ["--sp", "2"], policy=moe),
                    dpo("one-moe-accum4", 1, ["--grad-accum", "4"], policy=moe)))
print(f"{sum(results)}/{len(results)} cases passed in {time.time() - start:.1f} s")
if all(results): shutil.rmtree(work, ignore_errors=True)
sys.exit(0 if results and all(results) else 1)
