#!/usr/bin/env python3
"""`--attention` (sft, dpo, check, bench; YAML key `attention`): a value other than auto, own or cudnn
is an error naming the valid values before any work starts, on any machine (this runs on the CPU,
with or without the CUDA backend built); choosing a CUDA kernel for a run on the CPU is an error
too; `auto` is accepted everywhere."""
import os
import subprocess
import sys
import tempfile

spindle, root = sys.argv[1], sys.argv[2]
case = os.path.join(root, "testdata", "hf", "qwen2")
data = os.path.join(case, "data.jsonl")
pairs = os.path.join(root, "testdata", "dpo", "pairs.jsonl")
failures = []
VALID = "--attention: must be auto, own or cudnn"  # CLI11: the option, then the check's message


def run(args, cwd):
    return subprocess.run([spindle, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def expect_error(args, needle, cwd, output=None):
    r = run(args, cwd)
    what = " ".join(args[:1] + args[-2:])
    if r.returncode == 0 or needle not in r.stderr:
        failures.append(f"{what}: expected an error containing {needle!r}, got rc={r.returncode}: {r.stderr.strip()}")
    if output and os.path.exists(os.path.join(cwd, output, "metrics.jsonl")):
        failures.append(f"{what}: work started despite the bad --attention")


with tempfile.TemporaryDirectory() as tmp:
    train = ["--model", case, "--data", data, "--threads", "1", "--max-steps", "1", "--max-length", "32"]
    for command, extra in (("sft", train), ("dpo", ["--model", case, "--data", pairs, "--threads", "1"]),
                           ("check", train)):
        expect_error([command, *extra, "--output", f"{command}_bad", "--attention", "fast"],
                     VALID + ', got "fast"', tmp, f"{command}_bad")
        # An engine kernel by name is for the tests' API, not the command line.
        expect_error([command, *extra, "--output", f"{command}_wgmma", "--attention", "wgmma"],
                     VALID + ', got "wgmma"', tmp, f"{command}_wgmma")
        # A CUDA choice for a run on the CPU.
        expect_error([command, *extra, "--output", f"{command}_cpu", "--device", "cpu", "--attention", "own"],
                     "--attention own chooses among the CUDA backend's attention kernels", tmp, f"{command}_cpu")

    # Several processes: the launcher checks the value before it starts any, so the error appears once.
    bench_args = ["--model", case, "--seq", "16", "--device", "cpu"]
    for args in (["sft", *train, "--output", "sft_np2"], ["check", *train], ["bench", *bench_args]):
        r = run([*args, "--nproc-per-node", "2", "--attention", "fast"], tmp)
        if r.returncode == 0 or r.stderr.count(VALID) != 1 or "[rank" in r.stderr:
            failures.append(f"{args[0]} --nproc-per-node 2 --attention fast: expected one error before any rank "
                            f"starts, got rc={r.returncode}: {r.stderr.strip()}")

    # The YAML key goes through the same check.
    with open(os.path.join(tmp, "bad.yaml"), "w") as f:
        f.write(f"model: {case}\ndata: [{data}]\nmax_steps: 1\nthreads: 1\nattention: flash\n")
    expect_error(["sft", "--config", "bad.yaml", "--output", "yaml_bad"], VALID + ', got "flash"', tmp, "yaml_bad")

    bench = ["bench", "--model", case, "--seq", "16", "--steps", "1", "--warmup", "0", "--device", "cpu", "--threads", "1"]
    expect_error([*bench, "--attention", "fast"], VALID + ', got "fast"', tmp)
    expect_error([*bench, "--attention", "cudnn"], "--attention cudnn chooses among the CUDA backend's", tmp)

    # auto is accepted on the CPU, by flag and by YAML key.
    ok = run(["sft", *train, "--output", "auto_flag", "--device", "cpu", "--attention", "auto"], tmp)
    if ok.returncode != 0:
        failures.append(f"sft --device cpu --attention auto failed: {ok.stderr.strip()}")
    with open(os.path.join(tmp, "auto.yaml"), "w") as f:
        f.write(f"model: {case}\ndata: [{data}]\nmax_steps: 1\nmax_length: 32\nthreads: 1\nattention: auto\n")
    ok = run(["sft", "--config", "auto.yaml", "--output", "auto_yaml"], tmp)
    if ok.returncode != 0:
        failures.append(f"sft with 'attention: auto' in YAML failed: {ok.stderr.strip()}")
    ok = run([*bench, "--attention", "auto"], tmp)
    if ok.returncode != 0:
        failures.append(f"bench --device cpu --attention auto failed: {ok.stderr.strip()}")

for f in failures:
    print("FAIL:", f)
print("--attention checks:", "all passed" if not failures else f"{len(failures)} failed")
sys.exit(1 if failures else 0)
