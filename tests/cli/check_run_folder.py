#!/usr/bin/env python3
"""The output folder holds one run, and every check that can fail does so before training
(docs/usage.md, "The output folder").

- A folder holding a run is refused without --resume, and --resume with other options names each
  one that differs; the folder is left as it was. --overwrite-output replaces the run: the log then
  holds the new run's steps only. (The sequence of issue #39, which mixed two runs.)
- A folder of the user's own files (adapter/README.txt, metrics.jsonl) is refused before anything
  is written; --overwrite-output removes only what a run writes.
- --merge-output onto the model folder, or into a folder that is not empty, is refused at once.
- Missing data, a bad data line, a DPO file given to sft: errors that name the user's file and leave
  no folder behind; --skip-bad-samples skips the bad line and reports it.
- A full disk, as a file-size limit (RLIMIT_FSIZE): --resume reads the tokenized data back instead of
  writing it again, so it trains on with an intact checkpoint; a checkpoint that cannot be written
  is a clear error that leaves the previous checkpoint and no half-written folder.

usage: check_run_folder.py SPINDLE ROOT"""
import filecmp
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

spindle, root = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(root, "tests", "support"))
from tiny_model import config, write_model  # noqa: E402

failures = []
work = tempfile.mkdtemp(prefix="spindle-run-folder-")
model = os.path.join(work, "model")
write_model(model, config(model_type="qwen2", vocab_size=300), tokenizer_dir=os.path.join(root, "demo", "tokenizer"))
chat = os.path.join(root, "demo", "capitals.jsonl")


def run(args, limit_file_bytes=None):
    def limit():
        # A write past the limit fails with EFBIG, as one on a full disk fails with ENOSPC.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_bytes, limit_file_bytes))
    return subprocess.run([spindle, "sft", *args], capture_output=True, text=True, cwd=work,
                          preexec_fn=limit if limit_file_bytes else None)


def expect(what, r, needles, code=2):
    if r.returncode != code:
        failures.append(f"{what}: exit status {r.returncode}, expected {code}: {r.stderr[-600:]}")
    for needle in needles:
        if needle not in r.stderr:
            failures.append(f"{what}: the message lacks {needle!r}: {r.stderr[-600:]}")


def snapshot(folder):
    """Every file under `folder` with its bytes."""
    files = {}
    for base, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(base, name)
            files[os.path.relpath(path, folder)] = open(path, "rb").read()
    return files


def steps_logged(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


base = ["--model", model, "--data", chat, "--max-length", "128", "--threads", "1", "--log-every", "100"]

# Issue #39's sequence: two runs into one folder, then a resume that continued the older one.
stale = os.path.join(work, "stale")
first = base + ["--output", stale, "--save-steps", "2", "--max-steps", "4", "--lr", "1e-2"]
expect("first run", run(first), [], code=0)
before = snapshot(stale)
expect("another run into the folder", run(base + ["--output", stale, "--save-steps", "2", "--max-steps", "2",
                                                  "--lr", "1e-4"]),
       [f"--output {stale} already holds another run", "--resume", "--overwrite-output", "a new --output"])
expect("a resume with other options", run(base + ["--output", stale, "--save-steps", "2", "--max-steps", "6", "--resume"]),
       ["holds a run with other settings", "--lr: 0.01 in the folder's run, 0.0001 here"])
expect("the same run again without --resume", run(first), ["already holds an identical run", "--resume"])
expect("a resume at another --max-length", run([a if a != "128" else "64" for a in first] + ["--resume"]),
       ["--max-length: 128 in the folder's run, 64 here"])
if snapshot(stale) != before:
    failures.append("a refused run changed the folder")
# The same run resumed for more steps: a longer run, the schedule over the new total.
longer = os.path.join(work, "longer")
shutil.copytree(stale, longer)
expect("a resume for more steps", run(base + ["--output", longer, "--save-steps", "2", "--max-steps", "6", "--lr", "1e-2",
                                              "--resume"]),
       ["resuming from", "other --max-steps or --epochs"], code=0)
if os.path.isdir(longer) and steps_logged(longer) != [1, 2, 3, 4, 5, 6]:
    failures.append(f"a resume for 6 steps logged steps {steps_logged(longer)}")
expect("--resume and --overwrite-output together", run(first + ["--resume", "--overwrite-output"]),
       ["--resume continues the run in --output and --overwrite-output replaces it"])
replaced = base + ["--output", stale, "--max-steps", "2", "--lr", "1e-4", "--overwrite-output"]
expect("--overwrite-output", run(replaced), [], code=0)
if steps_logged(stale) != [1, 2] or os.path.exists(os.path.join(stale, "checkpoint-4")):
    failures.append(f"--overwrite-output kept the earlier run: steps {steps_logged(stale)}, {sorted(os.listdir(stale))}")
expect("resume of the finished replacement", run(replaced[:-1] + ["--resume"]), ["resuming from"], code=0)

# A folder of the user's files.
mine = os.path.join(work, "mine")
os.makedirs(os.path.join(mine, "adapter"))
open(os.path.join(mine, "adapter", "README.txt"), "w").write("my notes\n")
open(os.path.join(mine, "metrics.jsonl"), "w").write('{"mine": 1}\n')
open(os.path.join(mine, "notes.txt"), "w").write("keep me\n")
before = snapshot(mine)
expect("a folder of user files", run(base + ["--output", mine, "--max-steps", "2"]),
       [f"--output {mine} is not empty and holds no spindle run", "--overwrite-output"])
if snapshot(mine) != before:
    failures.append(f"a refused run wrote into the user's folder: {sorted(snapshot(mine))}")
expect("--overwrite-output over user files", run(base + ["--output", mine, "--max-steps", "2", "--overwrite-output"]),
       [], code=0)
if open(os.path.join(mine, "notes.txt")).read() != "keep me\n" or os.path.exists(os.path.join(mine, "adapter", "README.txt")):
    failures.append(f"--overwrite-output removed other files or kept what a run writes: {sorted(snapshot(mine))}")

# --merge-output checked before training.
merge_target = os.path.join(work, "merged")
os.makedirs(merge_target)
open(os.path.join(merge_target, "x.txt"), "w").write("x")
for what, target, needle in [("--merge-output onto the model", model, "is the --model folder"),
                             ("--merge-output into a full folder", merge_target, "is not empty")]:
    out = os.path.join(work, "merge-" + os.path.basename(target))
    expect(what, run(base + ["--output", out, "--max-steps", "2", "--merge-output", target]), [needle])
    if os.path.exists(out):
        failures.append(f"{what}: the output folder was created before the refusal")

# The summary names the merged model.
merged_run, merged = os.path.join(work, "merged-run"), os.path.join(work, "merged-model")
r = run(base + ["--output", merged_run, "--max-steps", "1", "--merge-output", merged])
expect("--merge-output", r, ["merged model", merged], code=0)
if not os.path.isfile(os.path.join(merged, "config.json")):
    failures.append("--merge-output wrote no model")

# Missing and bad inputs leave nothing behind.
nothing = os.path.join(work, "nothing")
expect("missing --data", run(base[:2] + ["--data", os.path.join(work, "nosuch.jsonl"), "--output", nothing]),
       ["--data", "nosuch.jsonl does not exist"])
bad = os.path.join(work, "bad.jsonl")
with open(chat) as source, open(bad, "w") as f:
    lines = source.readlines()
    f.writelines(lines[:10] + ["{not json\n"] + lines[10:20])
expect("a bad line", run(["--model", model, "--data", bad, "--output", nothing, "--threads", "1"]),
       [f"{bad}:11", "--skip-bad-samples"])
pairs = os.path.join(work, "pairs.jsonl")
open(pairs, "w").write(json.dumps({"prompt": "Capital of Peru?", "chosen": "Lima.", "rejected": "Quito."}) + "\n")
expect("a DPO file given to sft", run(["--model", model, "--data", pairs, "--output", nothing, "--threads", "1"]),
       [f"{pairs} holds preference pairs", "spindle dpo"])
if os.path.exists(nothing):
    failures.append(f"failed runs left {nothing} behind: {sorted(snapshot(nothing))}")
skipped = os.path.join(work, "skipped")
r = run(["--model", model, "--data", bad, "--output", skipped, "--threads", "1", "--max-steps", "1", "--skip-bad-samples"])
expect("--skip-bad-samples", r, ["skipped 1 bad samples", f"{bad}:11"], code=0)

# A full disk. The data's tokenized file is larger than the limit, the checkpoints smaller.
big = os.path.join(work, "big.jsonl")
with open(big, "w") as f:
    for _ in range(12):
        f.writelines(lines)
disk = os.path.join(work, "disk")
full_args = ["--model", model, "--data", big, "--output", disk, "--max-length", "128", "--threads", "1",
             "--max-steps", "6", "--save-steps", "3", "--lora-rank", "2", "--lr", "1e-2", "--log-every", "100"]
whole = os.path.join(work, "disk-whole")
expect("uninterrupted run", run(full_args[:5] + [whole] + full_args[6:]), [], code=0)
dataset_bytes = os.path.getsize(os.path.join(whole, "data", "train-0", "dataset.bin"))
largest_checkpoint_file = max(os.path.getsize(os.path.join(whole, "checkpoint-3", d, f))
                              for d in ["adapter", "."] for f in os.listdir(os.path.join(whole, "checkpoint-3", d))
                              if os.path.isfile(os.path.join(whole, "checkpoint-3", d, f)))
limit = (dataset_bytes + largest_checkpoint_file) // 2
if not largest_checkpoint_file * 2 < limit < dataset_bytes:
    failures.append(f"the full-disk case needs a checkpoint file ({largest_checkpoint_file} bytes) well below the "
                    f"tokenized data ({dataset_bytes} bytes)")
# The run killed after its checkpoint at step 3, as a preempted job would be.
shutil.copytree(whole, disk)
for later in ["checkpoint-6", "adapter"]:
    shutil.rmtree(os.path.join(disk, later))
r = run(full_args + ["--resume"], limit_file_bytes=limit)
expect("--resume on a full disk", r, ["tokenized earlier", "read from there", "resuming from"], code=0)
if r.returncode == 0 and not filecmp.cmp(os.path.join(disk, "adapter", "adapter_model.safetensors"),
                                         os.path.join(whole, "adapter", "adapter_model.safetensors"), shallow=False):
    failures.append("the run resumed on a full disk did not end as the uninterrupted one")
# A disk too full for a checkpoint: the data prepared beforehand, every write of a checkpoint fails.
tight = os.path.join(work, "tight")
prepared = os.path.join(whole, "data", "train-0")
tight_args = ["--model", model, "--data", prepared, "--output", tight, "--max-length", "128", "--threads", "1",
              "--max-steps", "6", "--save-steps", "3", "--lora-rank", "2", "--log-every", "100"]
r = run(tight_args, limit_file_bytes=2048)
expect("a checkpoint on a full disk", r, ["checkpoint-3", "File too large"])
leftovers = [n for n in os.listdir(tight) if ".tmp." in n or n.startswith("checkpoint-")] if os.path.isdir(tight) else []
if leftovers:
    failures.append(f"a failed checkpoint left {leftovers}")

for f in failures:
    print("FAIL:", f)
print("run output folders:", "all passed" if not failures else f"{len(failures)} failed")
if not failures:
    shutil.rmtree(work)
sys.exit(1 if failures else 0)
