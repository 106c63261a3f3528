#!/usr/bin/env python3
"""`spindle sft --config FILE.yaml`: the file sets the same options as flags, flags override it, and
unknown keys or wrong types are refused before any work with a message naming them."""
import json
import os
import subprocess
import sys
import tempfile

spindle, root = sys.argv[1], sys.argv[2]
case = os.path.join(root, "testdata", "hf", "qwen2")
failures = []


def run(args, cwd):
    return subprocess.run([spindle, "sft", *args], capture_output=True, text=True, cwd=cwd)


def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["loss"] for line in f]


with tempfile.TemporaryDirectory() as tmp:
    common = ["--model", case, "--data", os.path.join(case, "data.jsonl"), "--threads", "1"]
    # Flags only.
    flags = run(common + ["--output", "by_flags", "--max-steps", "3", "--lr", "0.01", "--lora-rank", "4",
                          "--max-length", "32"], tmp)
    if flags.returncode != 0:
        failures.append(f"flags run failed: {flags.stderr}")
    # The same options from YAML (dashes or underscores), output given on the command line.
    with open(os.path.join(tmp, "sft.yaml"), "w") as f:
        f.write(f"model: {case}\ndata:\n  - {os.path.join(case, 'data.jsonl')}\nmax_steps: 3\nlr: 0.5\n"
                "lora-rank: 4\nmax_length: 32\nthreads: 1\n")
    yaml_run = run(["--config", "sft.yaml", "--output", "by_yaml", "--lr", "0.01"], tmp)  # --lr overrides 0.5
    if yaml_run.returncode != 0:
        failures.append(f"yaml run failed: {yaml_run.stderr}")
    elif losses(os.path.join(tmp, "by_yaml")) != losses(os.path.join(tmp, "by_flags")):
        failures.append("YAML + override did not reproduce the flags-only run")

    # A JSON file is YAML too; --recompute keep-attention gives the losses of no recompute, bit for bit.
    with open(os.path.join(tmp, "sft.json"), "w") as f:
        json.dump({"model": case, "data": [os.path.join(case, "data.jsonl")], "max_steps": 3, "lr": 0.01,
                   "lora_rank": 4, "max_length": 32, "threads": 1, "recompute": "keep-attention"}, f)
    json_run = run(["--config", "sft.json", "--output", "by_json"], tmp)
    if json_run.returncode != 0:
        failures.append(f"json run with recompute keep-attention failed: {json_run.stderr}")
    elif flags.returncode == 0 and losses(os.path.join(tmp, "by_json")) != losses(os.path.join(tmp, "by_flags")):
        failures.append("recompute keep-attention (JSON config) did not reproduce the losses of recompute none")

    def expect_error(yaml_text, needle):
        with open(os.path.join(tmp, "bad.yaml"), "w") as f:
            f.write(yaml_text)
        r = run(["--config", "bad.yaml", "--output", "bad"], tmp)
        if r.returncode == 0 or needle not in r.stderr:
            failures.append(f"expected an error containing {needle!r}, got rc={r.returncode}: {r.stderr.strip()}")
        if os.path.exists(os.path.join(tmp, "bad", "metrics.jsonl")):
            failures.append(f"{needle!r}: work started despite the bad configuration")

    expect_error(f"model: {case}\nlearning_rate: 0.1\n", 'unknown key "learning_rate"')
    expect_error(f"model: {case}\nmax_steps: many\n", "max-steps")
    expect_error(f"model: {case}\nfull: maybe\n", '"full" must be true or false')
    expect_error(f"model: {case}\ndata: [{os.path.join(case, 'data.jsonl')}]\ngrad_accum: 0\n",
                 "--grad-accum must be positive")
    expect_error("model: [unclosed\n", "not valid YAML")
    expect_error(f"model: {case}\ndata: [{os.path.join(case, 'data.jsonl')}]\nrecompute: attention\n",
                 "--recompute: must be none, all, keep-attention or auto")

for f in failures:
    print("FAIL:", f)
print("sft config checks:", "all passed" if not failures else f"{len(failures)} failed")
sys.exit(1 if failures else 0)
