#!/usr/bin/env python3
"""The progress bar on a terminal, also under `--nproc-per-node`: the launcher tells its ranks that its
stderr is a terminal (and how wide), rank 0 draws the self-updating bar, and the launcher passes each
redraw on at once with its rank prefix after the carriage return, so the bar redraws in place instead
of printing `[rank 0] step …` lines. Run under a pseudo-terminal, as a user's shell runs it.

usage: check_progress_terminal.py SPINDLE ROOT"""
import os
import pty
import select
import subprocess
import sys
import tempfile

spindle, root = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(root, "tests", "support"))
from tiny_model import config, write_model  # noqa: E402

failures = []


def on_terminal(args):
    """Runs spindle with stderr (and stdout) on a pseudo-terminal; returns what the terminal received."""
    controller, terminal = pty.openpty()
    process = subprocess.Popen([spindle, *args], stdout=terminal, stderr=terminal, stdin=subprocess.DEVNULL)
    os.close(terminal)
    received = b""
    while True:
        ready, _, _ = select.select([controller], [], [], 120)
        if not ready:
            break
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal closed: every process that held it ended
            break
        if not chunk:
            break
        received += chunk
    process.wait(timeout=120)
    os.close(controller)
    return process.returncode, received.decode(errors="replace")


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "model")
    write_model(model, config(model_type="qwen2", vocab_size=300), tokenizer_dir=os.path.join(root, "demo", "tokenizer"))
    common = ["sft", "--model", model, "--data", os.path.join(root, "demo", "capitals.jsonl"), "--max-length", "128",
              "--max-steps", "6", "--threads", "1"]
    for what, extra, prefix in [("one process", [], ""), ("two processes", ["--nproc-per-node", "2"], "[rank 0] ")]:
        code, text = on_terminal(common + ["--output", os.path.join(tmp, what.replace(" ", "-"))] + extra)
        if code != 0:
            failures.append(f"{what}: exit status {code}: {text[-600:]}")
            continue
        # The bar: a redraw begins with '\r', then the prefix, then "NN% |" and the step count.
        redraws = [part for part in text.split("\r") if part.startswith(prefix + " ") or part.startswith(prefix + "1")]
        bars = [part for part in redraws if "%" in part and "|" in part and "/6" in part]
        if not bars:
            failures.append(f"{what}: no progress bar redrawn in place: {text[-800:]!r}")
        if f"{prefix}step 1/6" in text:
            failures.append(f"{what}: plain step lines on a terminal instead of the bar: {text[-800:]!r}")
        if "6/6" not in text or "Training finished" not in text:
            failures.append(f"{what}: the bar never reached the last step or no summary followed: {text[-800:]!r}")

for f in failures:
    print("FAIL:", f)
print("progress on a terminal:", "all passed" if not failures else f"{len(failures)} failed")
sys.exit(1 if failures else 0)
