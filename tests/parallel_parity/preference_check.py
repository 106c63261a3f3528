#!/usr/bin/env python3
"""`spindle check --objective dpo` for the preference losses without a reference (CPO, SimPO,
CPO-SimPO, ORPO) and DPO's sigmoid: the first global batch of `spindle dpo`'s step on a mesh of real
CPU processes against one process, with packing (several pairs per row, a pair's chosen and rejected
in the same row, sequences cut across ranks) and LoRA.

Each loss at sp 2 and sp 4 (Ulysses, ring and hybrid layouts) and with data parallelism: the loss,
the aux-free gradients of every LoRA tensor within check's F32 rounding tolerance (measured against
the same step in F64), and the same supervised targets (ORPO's include the chosen prompts').

usage: preference_check.py SPINDLE ROOT
"""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from tiny_model import config, write_model  # noqa: E402

spindle, root = sys.argv[1], sys.argv[2]
work = tempfile.mkdtemp(prefix="spindle-preference-check-")
tokenizer_dir = os.path.join(root, "demo", "tokenizer")
model = os.path.join(work, "model")
write_model(model, config(), tokenizer_dir=tokenizer_dir)


def make_pairs(path, seed=5):
    """The demo's capitals: the right one (chosen) against another (rejected), 1 to 3 sentences."""
    rng = random.Random(seed)
    facts = []
    for line in open(os.path.join(root, "demo", "capitals.jsonl")):
        m = json.loads(line)["messages"]
        facts.append((m[0]["content"], m[1]["content"]))
    with open(path, "w") as f:
        for question, answer in rng.sample(facts, 12):
            wrong = rng.choice([a for _, a in facts if a != answer])
            f.write(json.dumps({"prompt": question, "chosen": " ".join([f"{answer}."] * rng.randint(1, 3)),
                                "rejected": " ".join([f"It is {wrong}."] * rng.randint(1, 2))}) + "\n")


data = os.path.join(work, "pairs.jsonl")
make_pairs(data)
LOSSES = {
    "orpo": ["--loss-type", "orpo", "--beta", "0.25"],
    "simpo": ["--loss-type", "simpo", "--beta", "2.0", "--simpo-gamma", "0.6"],
    "cpo": ["--loss-type", "cpo", "--beta", "0.3", "--label-smoothing", "0.1"],
    "cpo-simpo": ["--loss-type", "simpo", "--beta", "1.5", "--cpo-alpha", "0.5"],
    "sigmoid": ["--loss-type", "sigmoid", "--beta", "0.5", "--rpo-alpha", "0.3"],
}


def check(loss, sp, dp, ulysses=None, ring=None, accum=2):
    cmd = [spindle, "check", "--objective", "dpo", "--model", model, "--data", data, "--max-length", "96",
           "--grad-accum", str(accum), "--sp", str(sp), "--dp", str(dp), "--nproc-per-node", str(sp * dp),
           "--lora-rank", "4", "--threads", "1", "--json"] + LOSSES[loss]
    if ulysses:
        cmd += ["--ulysses", str(ulysses)]
    if ring:
        cmd += ["--ring", str(ring)]
    name = f"{loss}: dp {dp} x sp {sp}" + (f" ulysses {ulysses}" if ulysses else "") + (f" ring {ring}" if ring else "")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    lines = [l for l in out.stdout.splitlines() if l.lstrip("[rank 0] ").startswith("{")]
    if not lines:
        print(f"FAIL {name}: exit {out.returncode}\n{out.stderr[-3000:]}")
        return False
    r = json.loads(lines[-1].split("] ", 1)[-1])
    ok = out.returncode == 0 and r["passed"] and r["num_items"] > 0 and r["rounding_measured"] and r["tensors"] > 0
    print(f"{'ok  ' if ok else 'FAIL'} {name}: rows {r['rows']} targets {r['num_items']}: loss {r['loss_single']:.6f} "
          f"rel {r['loss_relative_error']:.1e}, worst grad rel {r['worst_relative_error']:.1e} of "
          f"{r['worst_tolerance']:.1e} allowed ({r['worst_tensor']})", flush=True)
    return ok


results = [
    check("orpo", sp=2, dp=2, ulysses=2),
    check("orpo", sp=4, dp=1, ulysses=2, ring=2),
    check("simpo", sp=2, dp=2, ring=2),
    check("simpo", sp=4, dp=1, ulysses=4),
    check("cpo", sp=2, dp=2, ulysses=2),
    check("cpo", sp=4, dp=1, ring=4),
    check("cpo-simpo", sp=2, dp=1, ring=2, accum=3),
    check("sigmoid", sp=4, dp=1, ulysses=2, ring=2),
]
print(f"{sum(results)}/{len(results)} cases passed")
if all(results):
    shutil.rmtree(work, ignore_errors=True)
sys.exit(0 if all(results) else 1)
