#!/usr/bin/env python3
"""Every `--option` a message names is an option of the command that prints it.

Two ways in:
- The messages themselves: each command is run with the mistakes users make (bad data lines, a
  missing tokenizer, over-long documents, missing files, impossible values, reused folders), and every
  `--name` in what it prints must be an option of that command's parser (read from its --help).
- The source: every `--name` in a string literal of src/ must be an option of some command (or of
  another program a message tells the user to run); one in src/data/ (the JSONL readers and packing,
  which prepare, sft, dpo and check share) must be an option of all four of them, and one in src/train/
  or in the options sft, dpo and check share (cmd_sft.cpp) of those that can reach it, and one in the options
  that every command building a model declares (run_options.cpp) of all five of them.

usage: check_option_names.py SPINDLE ROOT"""
import json
import os
import re
import subprocess
import sys
import tempfile

spindle, root = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(root, "tests", "support"))
from tiny_model import config, write_model  # noqa: E402

OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")
COMMANDS = ["sft", "dpo", "check", "prepare", "eval", "generate", "tokenize", "bench", "plan"]
# Options of every command: the launcher's, and CLI11's own.
GLOBAL = {"--nproc-per-node", "--nproc_per_node", "--help", "--version"}
# Other programs' options that messages tell the user to run.
OTHER_PROGRAMS = {"--revision": "hf download", "--repo-type": "hf download", "--logdir": "tensorboard",
                  "--mem": "sbatch/srun", "--ipc": "docker run", "--shm-size": "docker run"}
# Literals whose option only the commands that have it can print, though their file reaches others.
ONLY_WHERE_SET = {
    ("src/train/run_folder.cpp", "--ref-model"): "names dpo's reference only when both runs are dpo runs",
    ("src/train/train_config.cpp", "--random-weights"): "printed only when --random-weights is set (sft)",
    ("src/cli/cmd_sft.cpp", "--random-weights"): "sft's own option, added beside the shared ones",
    ("src/cli/run_options.cpp", "--attention"): "declared by the commands that compute (not plan)",
    ("src/cli/run_options.cpp", "--dtype"): "declared by the commands that choose a precision (not bench)",
}
failures = []


def options_of(command):
    text = subprocess.run([spindle, command, "--help"], capture_output=True, text=True).stdout
    names = set(GLOBAL)
    for line in text.splitlines():
        m = re.match(r"\s+(-\S+)", line)
        if m:
            names.update(n for n in m.group(1).split(",") if n.startswith("--"))
    return names


def help_texts(command):
    """Each option's description in `spindle COMMAND --help` (CLI11 puts it after the name, type and
    default, or on the next line when those are long)."""
    lines = subprocess.run([spindle, command, "--help"], capture_output=True, text=True).stdout.splitlines()
    texts = {}
    for i, line in enumerate(lines):
        m = re.match(r"\s+(--[a-z0-9-]+)(?:\s\S+)*?(?:\s{2,}(\S.*))?\s*$", line)
        if not m:
            continue
        following = lines[i + 1].strip() if i + 1 < len(lines) else ""
        text = m.group(2) or ("" if following.startswith("-") else following)
        texts[m.group(1)] = text
    return texts


parsers = {c: options_of(c) for c in COMMANDS}
for c, names in parsers.items():
    if len(names) <= len(GLOBAL):
        failures.append(f"could not read the options of `spindle {c} --help`")


def check_messages(command, args, cwd, expect_failure=True):
    r = subprocess.run([spindle, command, *args], capture_output=True, text=True, cwd=cwd)
    text = r.stdout + r.stderr
    if expect_failure and r.returncode == 0:
        failures.append(f"spindle {command} {' '.join(args)}: expected an error, it succeeded")
    for name in sorted(set(OPTION.findall(text))):
        if name not in parsers[command]:
            line = next(l for l in text.splitlines() if name in l)
            failures.append(f"spindle {command} prints {name}, which it does not accept: {line.strip()}")
    return text


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "model")
    write_model(model, config(model_type="qwen2", vocab_size=300), tokenizer_dir=os.path.join(root, "demo", "tokenizer"))
    bare = os.path.join(tmp, "bare")  # the same model without a tokenizer
    write_model(bare, config(model_type="qwen2", vocab_size=300))
    chat = os.path.join(root, "demo", "capitals.jsonl")
    bad = os.path.join(tmp, "bad.jsonl")
    with open(bad, "w") as f:
        f.write(open(chat).readline())
        f.write("{not json\n")
    pairs = os.path.join(tmp, "pairs.jsonl")
    with open(pairs, "w") as f:
        f.write(json.dumps({"prompt": "Capital of Peru?", "chosen": "Lima.", "rejected": "Quito."}) + "\n")
    tokens = os.path.join(tmp, "tokens.jsonl")
    with open(tokens, "w") as f:
        f.write(json.dumps({"input_ids": list(range(1, 40)), "labels": list(range(1, 40))}) + "\n")
        f.write("[1, 2]\n")
    user_files = os.path.join(tmp, "user_files")
    os.makedirs(user_files)
    open(os.path.join(user_files, "notes.txt"), "w").write("mine\n")

    train = ["--model", model, "--max-steps", "1", "--threads", "1"]
    for command in ["sft", "check"]:
        out = ["--output", os.path.join(tmp, f"out-{command}")]
        check_messages(command, train + out + ["--data", bad], tmp)                       # a malformed line
        check_messages(command, ["--model", bare, "--max-steps", "1"] + out + ["--data", chat], tmp)  # no tokenizer
        check_messages(command, train + out + ["--data", chat, "--max-length", "8", "--over-length", "error"], tmp)
        check_messages(command, train + out + ["--data", os.path.join(tmp, "nosuch.jsonl")], tmp)
        check_messages(command, train + out + ["--data", chat, "--over-length", "cut"], tmp)
        check_messages(command, train + out + ["--data", chat, "--grad-accum", "0"], tmp)
        check_messages(command, train + out + ["--data", chat, "--lr-scheduler", "step"], tmp)
        check_messages(command, train + out + ["--data", chat, "--recompute-layers", "1"], tmp)
        check_messages(command, train + out + ["--data", chat, "--device", "cuda"], tmp)
        check_messages(command, train + out + ["--data", chat, "--lr", "1", "--lr", "2"], tmp)
    check_messages("sft", train + ["--output", os.path.join(tmp, "o1"), "--data", pairs], tmp)  # pairs to sft
    check_messages("dpo", train + ["--output", os.path.join(tmp, "o2"), "--data", chat], tmp)   # documents to dpo
    check_messages("dpo", train + ["--output", os.path.join(tmp, "o3"), "--data", bad], tmp)
    check_messages("dpo", ["--model", bare, "--max-steps", "1", "--output", os.path.join(tmp, "o4"), "--data", pairs], tmp)
    check_messages("dpo", train + ["--output", os.path.join(tmp, "o5"), "--data", pairs, "--beta", "-1"], tmp)
    check_messages("sft", train + ["--output", user_files, "--data", chat], tmp)                 # a folder of user files
    check_messages("sft", train + ["--output", os.path.join(tmp, "o6"), "--data", chat, "--resume"], tmp)
    check_messages("sft", train + ["--output", os.path.join(tmp, "o7"), "--data", chat, "--merge-output", model], tmp)
    check_messages("sft", train + ["--output", os.path.join(tmp, "o8"), "--data", chat, "--seed", "-1"], tmp)
    check_messages("sft", ["--config", os.path.join(tmp, "nosuch.yaml")], tmp)
    # A run, then the same folder reused without --resume and resumed with other options.
    done = ["--model", model, "--data", chat, "--output", os.path.join(tmp, "done"), "--max-steps", "2",
            "--max-length", "64", "--threads", "1"]
    r = subprocess.run([spindle, "sft", *done], capture_output=True, text=True)
    if r.returncode != 0:
        failures.append(f"a two-step run failed: {r.stderr[-500:]}")
    check_messages("sft", done, tmp)
    check_messages("sft", done[:-4] + ["--max-length", "32", "--threads", "1", "--resume"], tmp)
    # The CLI's own messages, each in words of its own.
    for args, needle in [(["sft", "--lr", "1", "--lr", "2"], "--lr is given 2 times; give it once"),
                         (["sft", "--config", "nosuch.yaml"], "--config nosuch.yaml: no such file"),
                         (["sft", "--seed", "-1"], "--seed: must be a whole number from 0 to 18446744073709551615")]:
        r = subprocess.run([spindle, *args], capture_output=True, text=True, cwd=tmp)
        if r.returncode != 2 or needle not in r.stderr:
            failures.append(f"spindle {' '.join(args)}: exit status {r.returncode}, expected 2 and {needle!r}: "
                            f"{r.stderr.strip()}")
    r = subprocess.run([spindle, "--version"], capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.startswith("spindle ") or "CPU backend" not in r.stdout:
        failures.append(f"spindle --version: exit status {r.returncode}, printed {r.stdout!r} {r.stderr!r}")
    prepare = ["--tokenizer", model, "--max-length", "64"]
    check_messages("prepare", prepare + ["--data", bad, "--output", os.path.join(tmp, "p1")], tmp)
    check_messages("prepare", ["--max-length", "64", "--data", chat, "--output", os.path.join(tmp, "p2")], tmp)
    check_messages("prepare", ["--tokenizer", model, "--max-length", "4", "--over-length", "error", "--data", chat,
                               "--output", os.path.join(tmp, "p3")], tmp)
    check_messages("eval", ["--model", model, "--data", tokens], tmp)
    check_messages("eval", ["--model", model, "--data", tokens, "--max-length", "8", "--over-length", "error"], tmp)

# The options that say what a run builds: one declaration (cli/run_options.cpp) gives each the same
# help in every command that builds a model; a command that declares one again shows here.
RUN_OPTIONS = ["--lora-rank", "--lora-alpha", "--lora-targets", "--full", "--quantize", "--double-quant",
               "--quant-block-size", "--recompute", "--recompute-layers", "--offload", "--offload-layers",
               "--mlp-tile-tokens", "--checkpoint-stride", "--device-memory", "--host-memory",
               "--router-aux-loss-coef", "--dp", "--sp", "--ulysses", "--ring"]
RUN_COMMANDS = ["sft", "dpo", "check", "bench", "plan"]
helps = {c: help_texts(c) for c in RUN_COMMANDS}
for option in RUN_OPTIONS:
    texts = {c: helps[c].get(option) for c in RUN_COMMANDS}
    missing = [c for c, t in texts.items() if t is None]
    if missing:
        failures.append(f"{option}: not an option of {', '.join(missing)}")
    if len({t for t in texts.values() if t is not None}) > 1:
        failures.append(f"{option} is described differently: " + "; ".join(f"{c}: {t!r}" for c, t in texts.items()))
for option in ["--attention", "--dtype"]:  # the commands that take them, alike
    texts = {c: helps[c][option] for c in RUN_COMMANDS if option in helps[c]}
    if len(set(texts.values())) > 1:
        failures.append(f"{option} is described differently: {texts}")

# The source: string literals of src/.
def literals(path):
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"//[^\n]*", "", text)
    return re.findall(r'"((?:[^"\\\n]|\\.)*)"', text)


everywhere = set().union(*parsers.values())
data_commands = ["sft", "dpo", "check", "prepare"]
train_commands = {"dpo_trainer.cpp": ["dpo"], "preference_step.cpp": ["dpo"], "check.cpp": ["check"],
                  "trainer.cpp": ["sft", "dpo"]}
# The options every command that builds a model declares from one place (cli/run_options.cpp).
run_commands = ["sft", "dpo", "check", "bench", "plan"]
for folder, _, files in os.walk(os.path.join(root, "src")):
    for name in files:
        if not name.endswith((".cpp", ".h", ".cu")):
            continue
        path = os.path.join(folder, name)
        relative = os.path.relpath(path, root)
        if relative.startswith("src/data/"):
            reach = data_commands
        elif relative.startswith("src/train/"):
            reach = train_commands.get(name, ["sft", "dpo", "check"])
        elif relative == "src/cli/cmd_sft.cpp":
            reach = ["sft", "dpo", "check"]
        elif relative == "src/cli/run_options.cpp":
            reach = run_commands
        elif relative.startswith("src/cli/cmd_") and name[4:-4] in parsers:
            reach = [name[4:-4]]
        else:
            reach = []
        for literal in literals(path):
            for option in OPTION.findall(literal):
                if option in OTHER_PROGRAMS or option in GLOBAL:
                    continue
                if option not in everywhere:
                    failures.append(f"{relative}: \"{literal[:120]}\" names {option}, which no command accepts")
                    continue
                if (relative, option) in ONLY_WHERE_SET:
                    continue
                missing = [c for c in reach if option not in parsers[c]]
                if missing:
                    failures.append(f"{relative}: \"{literal[:120]}\" names {option}, which {', '.join(missing)} "
                                    "cannot take, though its messages reach them")

for f in failures:
    print("FAIL:", f)
print("option names in messages:", "all exist" if not failures else f"{len(failures)} problems")
sys.exit(1 if failures else 0)
