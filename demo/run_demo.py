#!/usr/bin/env python3
"""`make demo`: fine-tune a tiny randomly initialised Qwen2-architecture model on the bundled chat
dataset (country -> capital) on the CPU, then show what it learned.

Everything runs through the spindle binary: `spindle generate` answers the questions before and
after training, `spindle check` proves the 2-process sequence-parallel mesh exact, and
`spindle sft --full --nproc-per-node 2 --sp 2` trains with each sequence split over two processes.
The model is created at run time in demo/work/ (never committed); the tokenizer and the dataset ship
in demo/."""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import make_dataset

HERE = os.path.dirname(os.path.abspath(__file__))
DATASET = os.path.join(HERE, "capitals.jsonl")
SHOWCASE = ["France", "Japan", "Brazil", "Kenya", "United Kingdom", "Argentina"]
SEED = 0


def bold(text):
    return f"\033[1m{text}\033[0m" if sys.stdout.isatty() else text


def heading(text):
    print(f"\n{bold('== ' + text)}", flush=True)


def run(cmd, capture=False):
    result = subprocess.run(cmd, stdout=subprocess.PIPE if capture else None, text=True)
    if result.returncode != 0:
        sys.exit(f"demo: `{' '.join(cmd)}` failed with exit code {result.returncode}")
    return result.stdout




def answer_all(spindle, model, questions_file):
    """Greedy answers of `model` to every question, in dataset order."""
    out = run([spindle, "generate", "--model", model, "--input", questions_file, "--max-new-tokens", "12", "--json"],
              capture=True)
    return [json.loads(line)["text"].strip() for line in out.splitlines()]


def accuracy(answers, expected):
    return sum(a == e for a, e in zip(answers, expected)) / len(expected)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--spindle", required=True, help="the spindle binary")
    parser.add_argument("--work", default=os.path.join(HERE, "work"), help="scratch folder (recreated)")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    spindle = os.path.abspath(args.spindle)
    sys.stdout.reconfigure(line_buffering=True)  # interleave in order with spindle's stderr progress
    started = time.time()

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    base = os.path.join(args.work, "base-model")
    run_dir = os.path.join(args.work, "run")

    countries, expected = zip(*make_dataset.pairs())
    questions_file = os.path.join(args.work, "questions.jsonl")
    with open(questions_file, "w") as f:
        for country in countries:
            f.write(json.dumps({"messages": [{"role": "user", "content": make_dataset.question(country)}]}) + "\n")

    heading("1. A tiny model with random weights")
    run([sys.executable, os.path.join(HERE, "make_model.py"), base, "--seed", str(SEED)])
    print(f"dataset: {os.path.relpath(DATASET)}: {len(countries)} chat turns like")
    print(f"  user: {make_dataset.question(countries[0])}\n  assistant: {expected[0]}")

    heading("2. Before training (spindle generate)")
    before = answer_all(spindle, base, questions_file)

    # Each packed row of 256 tokens is split over 2 processes (sequence parallelism, Ulysses: the
    # 4 attention heads are shared out by an all-to-all). `spindle check` first proves that this
    # mesh computes what one process computes, then the same options train.
    common = ["--model", base, "--data", DATASET, "--full", "--max-length", "256", "--seed", str(SEED),
              "--nproc-per-node", "2", "--sp", "2"]
    heading("3. Is the 2-process mesh exact? (spindle check: one step on the mesh vs one process)")
    check = [spindle, "check"] + common + ["--output", os.path.join(args.work, "check")]
    print("$ " + " ".join(os.path.relpath(a) if os.path.exists(a) else a for a in check), flush=True)
    run(check)

    heading(f"4. Full fine-tune, {args.steps} steps, each sequence split over 2 processes (spindle sft --sp 2)")
    sft = [spindle, "sft"] + common + ["--output", run_dir, "--max-steps", str(args.steps), "--lr", "1e-3",
                                       "--lr-scheduler", "cosine", "--warmup-steps", "10", "--log-every", "20"]
    print("$ " + " ".join(os.path.relpath(a) if os.path.exists(a) else a for a in sft), flush=True)
    run(sft)
    trained = os.path.join(run_dir, "model")

    heading("5. After training (spindle generate)")
    after = answer_all(spindle, trained, questions_file)

    width = max(len(c) for c in SHOWCASE) + 1
    print(f"  {'question: capital of':<{width}}  {'before':<22}  {'after':<16}  expected")
    for country in SHOWCASE:
        i = countries.index(country)
        mark = "ok" if after[i] == expected[i] else "wrong"
        print(f"  {country + '?':<{width}}  {before[i][:20]!r:<22}  {after[i][:14]!r:<16}  {expected[i]}  {mark}")
    print(f"\nexact-match accuracy over all {len(expected)} questions: "
          f"{bold(f'{accuracy(before, expected):.0%} before -> {accuracy(after, expected):.0%} after')}")

    heading("Done in {:.0f} s".format(time.time() - started))
    print(f"""trained model   {os.path.relpath(trained)}   (Hugging Face folder: config, safetensors, tokenizer)
metrics         {os.path.relpath(os.path.join(run_dir, 'metrics.jsonl'))}   loss curve: {os.path.relpath(os.path.join(run_dir, 'metrics.svg'))}
ask it yourself {os.path.relpath(spindle)} generate --model {os.path.relpath(trained)} --chat --prompt "What is the capital of Peru?"
in Python       from transformers import AutoModelForCausalLM, AutoTokenizer
                model = AutoModelForCausalLM.from_pretrained("{os.path.relpath(trained)}")
                tokenizer = AutoTokenizer.from_pretrained("{os.path.relpath(trained)}")""")


if __name__ == "__main__":
    main()
