#!/usr/bin/env python3
"""`spindle bench` on 2 processes (CPU, Gloo) reports the same loss as one process (every rank holds
only its shard's share of the step's loss, so the report must sum it over the ranks first), and its
time split counts the collectives: one process has none, two have the sequence-parallel exchange
and FSDP's gathers, each listed in the op table under its group's name."""
import json
import os
import subprocess
import sys
import tempfile

spindle, root = sys.argv[1], sys.argv[2]
model = os.path.join(root, "testdata", "hf", "qwen2")
common = [spindle, "bench", "--device", "cpu", "--threads", "1", "--model", model, "--seq", "64",
          "--lora-rank", "4", "--steps", "1", "--warmup", "0", "--profile-steps", "1"]


def loss(extra):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "bench.json")
        run = subprocess.run(common + extra + ["--json-file", report], capture_output=True, text=True, timeout=300)
        if run.returncode != 0:
            sys.exit(f"spindle bench {' '.join(extra)} failed:\n{run.stdout}{run.stderr}")
        with open(report) as f:
            return json.load(f)["results"][0]


def communication(result):
    split = result["split_ms"]
    calls = [o for o in result["ops"] if o["category"] in ("communication", "overlapped_communication")]
    return split["communication"] + split["overlapped_communication"], calls


single = loss([])
one = single["loss"]
failures = []
ms, calls = communication(single)
print(f"1 process: {ms:.3f} ms of collectives, {len(calls)} kinds")
if ms != 0 or calls:
    failures.append("collectives timed in a one-process run")
for mesh in (["--sp", "2"], ["--sp", "2", "--ring", "2"]):
    result = loss(["--nproc-per-node", "2"] + mesh)
    two = result["loss"]
    ok = abs(two - one) <= 1e-5 * abs(one)
    print(f"loss {' '.join(mesh)}: {two:.7f} vs 1 process {one:.7f}: {'ok' if ok else 'MISMATCH'}")
    if not ok:
        failures.append(mesh)
    ms, calls = communication(result)
    names = sorted({c["op"].rsplit(" ", 2)[0] for c in calls})
    print(f"  {ms:.3f} ms of collectives: {', '.join(names)}")
    # FSDP gathers the parameters over the world; the sequence exchange is an all_to_all
    # (Ulysses) or send_recv steps (ring) in the sp group.
    want = "all_to_all" if "--ring" not in mesh else "send_recv"
    if ms <= 0 or not any(n.startswith("world ") and "all_gather" in n for n in names) or \
            not any(want in n for n in names):
        failures.append(f"{mesh}: collectives missing from the time split: {names}")
sys.exit(1 if failures else 0)
