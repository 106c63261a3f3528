#!/usr/bin/env python3
"""`spindle bench` on 2 processes (CPU, Gloo) reports the same loss as one process: every rank holds
only its shard's share of the step's loss, so the report must sum it over the ranks first."""
import json
import os
import subprocess
import sys
import tempfile

spindle, root = sys.argv[1], sys.argv[2]
model = os.path.join(root, "testdata", "hf", "qwen2")
common = [spindle, "bench", "--device", "cpu", "--threads", "1", "--model", model, "--seq", "64",
          "--lora-rank", "4", "--steps", "1", "--warmup", "0", "--profile-steps", "0"]


def loss(extra):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "bench.json")
        run = subprocess.run(common + extra + ["--json-file", report], capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            sys.exit(f"spindle bench {' '.join(extra)} failed:\n{run.stdout}{run.stderr}")
        with open(report) as f:
            return json.load(f)["results"][0]["loss"]


one = loss([])
failures = []
for mesh in (["--sp", "2"], ["--sp", "2", "--ring", "2"]):
    two = loss(["--nproc-per-node", "2"] + mesh)
    ok = abs(two - one) <= 1e-5 * abs(one)
    print(f"loss {' '.join(mesh)}: {two:.7f} vs 1 process {one:.7f}: {'ok' if ok else 'MISMATCH'}")
    if not ok:
        failures.append(mesh)
sys.exit(1 if failures else 0)
