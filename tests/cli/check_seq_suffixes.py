#!/usr/bin/env python3
"""--seq takes k (1024 tokens) and M (1024k) suffixes: `spindle plan --seq 1M` plans the same row as
--seq 1048576 and --seq 1024k; a list mixes forms; an unknown suffix is refused with the accepted forms."""
import json
import os
import subprocess
import sys

spindle, root = sys.argv[1], sys.argv[2]
model = os.path.join(root, "testdata", "hf", "llama")


def plan(seq):
    out = subprocess.run([spindle, "plan", "--model", model, "--seq", seq, "--recompute", "all", "--json"],
                         capture_output=True, text=True)
    return out


failures = 0
docs = {}
for seq in ["1M", "1048576", "1024k", "1m"]:
    out = plan(seq)
    if out.returncode != 0:
        print(f"--seq {seq}: exit {out.returncode}: {out.stderr.strip()}")
        failures += 1
        continue
    docs[seq] = json.loads(out.stdout)
texts = {seq: json.dumps(d, sort_keys=True) for seq, d in docs.items()}
same = len(set(texts.values())) == 1 and len(texts) == 4
print(f"--seq 1M, 1048576, 1024k, 1m plan the same row: {'yes' if same else 'NO'}")
failures += not same
out = plan("2k,1M")
ok = out.returncode == 0 and "1048576" in out.stdout and "2048" in out.stdout
print(f"--seq 2k,1M: {'both lengths planned' if ok else 'FAILED: ' + out.stderr.strip()}")
failures += not ok
out = plan("1G")
ok = out.returncode != 0 and "1M" in out.stderr and "32k" in out.stderr
print(f"--seq 1G: {'refused, naming the accepted forms' if ok else 'NOT REFUSED as expected: ' + out.stderr.strip()}")
failures += not ok
sys.exit(1 if failures else 0)
