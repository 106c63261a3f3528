#!/usr/bin/env python3
"""`--tensorboard DIR` (sft, dpo; YAML key `tensorboard`): the event files spindle writes are read
back with the `tensorboard` package itself (its raw event-file loader and the event accumulator
TensorBoard's dashboards use), and every scalar equals the metrics.jsonl value of the same step and
key (as float32, TensorBoard's scalar type). A resumed run's restart marker makes TensorBoard drop
the interrupted run's steps after the checkpoint, as metrics.jsonl drops them.

usage: check_tensorboard.py SPINDLE ROOT"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

try:
    import numpy as np
    from tensorboard.backend.event_processing import event_accumulator, event_file_loader
except ImportError as e:
    sys.exit(f"check_tensorboard needs the tensorboard package ({e}): python3 -m pip install tensorboard "
             "(make deps installs it)")

spindle, root = sys.argv[1], sys.argv[2]
sft_case = os.path.join(root, "testdata", "hf", "qwen2")
dpo_case = os.path.join(root, "testdata", "dpo")
failures = []


def run(command, args, cwd):
    r = subprocess.run([spindle, command, *args], capture_output=True, text=True, cwd=cwd)
    if r.returncode != 0:
        failures.append(f"spindle {command} {' '.join(args)} failed (rc {r.returncode}): {r.stderr[-2000:]}")
    return r.returncode == 0


def jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def tag_of(key):
    return "eval/" + key[len("eval_"):] if key.startswith("eval_") else "train/" + key


def event_files(tb_dir):
    return sorted(os.path.join(tb_dir, n) for n in os.listdir(tb_dir) if n.startswith("events.out.tfevents."))


def check_files(name, tb_dir, expected_files):
    files = event_files(tb_dir)
    if len(files) != expected_files:
        failures.append(f"{name}: {len(files)} event files in {tb_dir}, expected {expected_files}")
    pattern = re.compile(r"events\.out\.tfevents\.\d{10}\." + re.escape(socket.gethostname()) + "$")
    for path in files:
        if not pattern.match(os.path.basename(path)):
            failures.append(f"{name}: event file name {os.path.basename(path)} is not events.out.tfevents.<time>.<host>")
        # TensorBoard's own record reader: CRCs checked, payloads parsed with its event.proto.
        events = list(event_file_loader.EventFileLoader(path).Load())
        if not events or events[0].file_version != "brain.Event:2":
            failures.append(f"{name}: first record of {path} is not the brain.Event:2 header")


def check_scalars(name, tb_dir, records):
    """Every key of every metrics.jsonl record (but the step) is the scalar of its tag at that step."""
    acc = event_accumulator.EventAccumulator(tb_dir, size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    expected = {}  # tag -> [(step, value)]
    for record in records:
        for key, value in record.items():
            if key == "step":
                continue
            value = float("nan") if value is None else value
            expected.setdefault(tag_of(key), []).append((record["step"], np.float32(value)))
    tags = set(acc.Tags()["scalars"])
    if tags != set(expected):
        failures.append(f"{name}: TensorBoard tags {sorted(tags)} != metrics.jsonl keys as tags {sorted(expected)}")
    for tag in sorted(tags & set(expected)):
        got = [(e.step, np.float32(e.value)) for e in acc.Scalars(tag)]
        want = expected[tag]
        same = len(got) == len(want) and all(
            gs == ws and (gv == wv or (np.isnan(gv) and np.isnan(wv))) for (gs, gv), (ws, wv) in zip(got, want))
        if not same:
            failures.append(f"{name}: {tag}: TensorBoard has {got}, metrics.jsonl {want}")
    return tags


with tempfile.TemporaryDirectory() as tmp:
    # SFT with evaluation every 2 steps and checkpoints every 2, the TensorBoard folder from YAML.
    with open(os.path.join(tmp, "sft.yaml"), "w") as f:
        f.write("tensorboard: tb_sft\n")
    def sft(steps):
        return ["--model", sft_case, "--data", os.path.join(sft_case, "data.jsonl"), "--threads", "1",
                "--max-length", "32", "--lora-rank", "4", "--lr", "0.01", "--max-steps", steps,
                "--eval-data", os.path.join(sft_case, "data.jsonl"), "--eval-steps", "2", "--save-steps", "2",
                "--output", "sft", "--log-every", "100"]

    if run("sft", ["--config", "sft.yaml", *sft("4")], tmp):
        tb = os.path.join(tmp, "tb_sft")
        records = jsonl(os.path.join(tmp, "sft", "metrics.jsonl"))
        check_files("sft", tb, 1)
        tags = check_scalars("sft", tb, records)
        for needed in ("train/loss", "train/grad_norm", "train/lr", "train/tokens_per_s", "train/num_items",
                       "train/peak_memory", "eval/loss"):
            if needed not in tags:
                failures.append(f"sft: no {needed} scalar")
        if [r["step"] for r in records if "eval_loss" in r] != [2, 4]:
            failures.append(f"sft: eval at steps {[r['step'] for r in records if 'eval_loss' in r]}, expected [2, 4]")

        # Killed after step 4 but its last checkpoint at step 2: resume from there for 6 steps, so
        # the linear schedule's steps 3 and 4 differ; TensorBoard must show only the resumed run's.
        first_run_lr = [r["lr"] for r in records]
        shutil.rmtree(os.path.join(tmp, "sft", "checkpoint-4"))
        if run("sft", [*sft("6"), "--tensorboard", "tb_sft", "--resume"], tmp):
            resumed = jsonl(os.path.join(tmp, "sft", "metrics.jsonl"))
            if [r["step"] for r in resumed] != [1, 2, 3, 4, 5, 6] or [r["lr"] for r in resumed][2:4] == first_run_lr[2:]:
                failures.append(f"sft resume: metrics.jsonl steps/lr unexpected: {resumed}")
            check_files("sft resumed", tb, 2)
            check_scalars("sft resumed", tb, resumed)

    # DPO: its own metrics (rewards, accuracies, log-probabilities; eval accuracy) are scalars too.
    # The demo's tiny random model with its byte-level tokenizer, on text pairs.
    model = os.path.join(tmp, "dpo_model")
    subprocess.run([sys.executable, os.path.join(root, "demo", "make_model.py"), model, "--hidden-size", "32",
                    "--intermediate-size", "64", "--layers", "1", "--heads", "2", "--kv-heads", "1"],
                   check=True, capture_output=True)
    pairs = os.path.join(tmp, "pairs.jsonl")
    with open(pairs, "w") as f:
        for country, capital, wrong in (("Peru", "Lima", "Paris"), ("Japan", "Tokyo", "Oslo"),
                                        ("Kenya", "Nairobi", "Lima"), ("Chile", "Santiago", "Rome")):
            f.write(json.dumps({"prompt": f"What is the capital of {country}?", "chosen": f"{capital}.",
                                "rejected": f"It is {wrong}."}) + "\n")
    dpo = ["--model", model, "--data", pairs, "--threads", "1", "--max-length", "64", "--max-steps", "2",
           "--eval-data", pairs, "--eval-steps", "1", "--output", "dpo", "--tensorboard", "tb_dpo",
           "--log-every", "100"]
    if run("dpo", dpo, tmp):
        tb = os.path.join(tmp, "tb_dpo")
        check_files("dpo", tb, 1)
        tags = check_scalars("dpo", tb, jsonl(os.path.join(tmp, "dpo", "metrics.jsonl")))
        for needed in ("train/rewards/chosen", "train/rewards/accuracies", "train/rewards/margins",
                       "train/logps/chosen", "eval/loss", "eval/rewards/accuracies"):
            if needed not in tags:
                failures.append(f"dpo: no {needed} scalar")

for f in failures:
    print("FAIL:", f)
print("tensorboard checks:", "all passed" if not failures else f"{len(failures)} failed")
sys.exit(1 if failures else 0)
