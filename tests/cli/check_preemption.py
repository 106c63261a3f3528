#!/usr/bin/env python3
"""Stop signals and exact resume, as a cluster delivers them (docs/usage.md, "Stopping and resuming").

A run that gets SIGTERM, SIGINT or SIGUSR1 mid-run finishes its step, saves a checkpoint there,
writes its loss plot and summary and exits with 75; `--resume` then continues it, and the whole
curve (every step's loss, gradient norm and learning rate) and the trained weights equal an
uninterrupted run's bit for bit. Cases: sft LoRA and full and dpo on one process; on two processes
(`--nproc-per-node 2`) LoRA with each row split over both (--sp 2) and a full fine-tune sharded over
two data-parallel replicas (FSDP), the signal sent to the launcher or to one rank only (every rank
stops after the same step); SIGKILL of the launcher, then --resume. A second signal stops at once,
without a checkpoint.

usage: check_preemption.py SPINDLE ROOT"""
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time

spindle, root = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(root, "tests", "support"))
from tiny_model import config, write_model  # noqa: E402

EXIT_STOPPED_RESUMABLE = 75
failures = []
work = tempfile.mkdtemp(prefix="spindle-preemption-")
model = os.path.join(work, "model")
write_model(model, config(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96),
            tokenizer_dir=os.path.join(root, "demo", "tokenizer"))
chat = os.path.join(root, "demo", "capitals.jsonl")
pairs = os.path.join(work, "pairs.jsonl")
with open(chat) as source, open(pairs, "w") as f:
    facts = [(m[0]["content"], m[1]["content"]) for m in (json.loads(line)["messages"] for line in source)]
    for i, (question, answer) in enumerate(facts[:24]):
        f.write(json.dumps({"prompt": question, "chosen": f"{answer}.", "rejected": f"It is {facts[i - 1][1]}."}) + "\n")


def records(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def logged(out):
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return sum(1 for line in f if line.endswith("\n"))
    except FileNotFoundError:
        return 0


def run(command, args, out):
    return subprocess.run([spindle, command, *args, "--output", out], capture_output=True, text=True)


def start(command, args, out):
    return subprocess.Popen([spindle, command, *args, "--output", out], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_steps(process, out, steps, what):
    deadline = time.time() + 120
    while logged(out) < steps:
        if process.poll() is not None or time.time() > deadline:
            failures.append(f"{what}: the run ended (or hung) before logging {steps} steps")
            return False
        time.sleep(0.01)
    return True


def rank_pid(launcher, rank):
    """The pid of the launcher's child whose RANK is `rank`."""
    with open(f"/proc/{launcher}/task/{launcher}/children") as f:
        children = [int(p) for p in f.read().split()]
    for child in children:
        with open(f"/proc/{child}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return child
    raise RuntimeError(f"no rank {rank} among {children}")


def same_curve(what, resumed, whole):
    a, b = records(resumed), records(whole)
    if len(a) != len(b):
        failures.append(f"{what}: {len(a)} steps logged after the resume, {len(b)} uninterrupted")
        return
    for x, y in zip(a, b):
        for key in ("step", "loss", "grad_norm", "lr", "num_items"):
            if x[key] != y[key]:
                failures.append(f"{what}: step {y['step']} {key} {x[key]!r} resumed, {y[key]!r} uninterrupted")
                return


def tensors(path):
    """name -> (dtype, shape, bytes) of a safetensors file: the order of its tensors does not matter."""
    with open(path, "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        data = f.read()
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def same_weights(what, resumed, whole, full):
    trained = os.path.join("model", "model.safetensors") if full else os.path.join("adapter", "adapter_model.safetensors")
    if tensors(os.path.join(resumed, trained)) != tensors(os.path.join(whole, trained)):
        failures.append(f"{what}: the trained {trained} differs from the uninterrupted run's")


def stop_and_resume(what, command, args, send, full=False, steps_before=3):
    """`send(process)` delivers the stop; the run must stop with a checkpoint, resume and end exactly
    where the uninterrupted run ends."""
    whole, cut = os.path.join(work, what + "-whole"), os.path.join(work, what + "-cut")
    r = run(command, args, whole)
    if r.returncode != 0:
        failures.append(f"{what}: the uninterrupted run failed: {r.stderr[-800:]}")
        return
    process = start(command, args, cut)
    if not wait_for_steps(process, cut, steps_before, what):
        process.kill()
        process.communicate()
        return
    signal_name = send(process)
    _, stderr = process.communicate(timeout=120)
    if process.returncode != EXIT_STOPPED_RESUMABLE:
        failures.append(f"{what}: exit status {process.returncode} after {signal_name}, expected "
                        f"{EXIT_STOPPED_RESUMABLE}: {stderr[-800:]}")
        return
    stopped_at = logged(cut)
    checkpoint = os.path.join(cut, f"checkpoint-{stopped_at}")
    if not os.path.isfile(os.path.join(checkpoint, "trainer_state.json")):
        failures.append(f"{what}: no checkpoint-{stopped_at} after stopping at step {stopped_at}: {os.listdir(cut)}")
    if f"Stopped by {signal_name}" not in stderr or f"Training stopped at step {stopped_at} of" not in stderr:
        failures.append(f"{what}: the summary does not say the run stopped at step {stopped_at}: {stderr[-800:]}")
    if not os.path.isfile(os.path.join(cut, "metrics.svg")):
        failures.append(f"{what}: no loss plot after the stop")
    if os.path.exists(os.path.join(cut, "adapter")) or os.path.exists(os.path.join(cut, "model")):
        failures.append(f"{what}: a stopped run exported a final model as if it had finished")
    r = run(command, args + ["--resume"], cut)
    if r.returncode != 0:
        failures.append(f"{what}: the resumed run failed: {r.stderr[-800:]}")
        return
    if f"resuming from {checkpoint}" not in r.stderr:
        failures.append(f"{what}: the resumed run did not start from {checkpoint}: {r.stderr[-400:]}")
    same_curve(what, cut, whole)
    same_weights(what, cut, whole, full)


def send_to(signal_number):
    def send(process):
        process.send_signal(signal_number)
        return signal.Signals(signal_number).name
    return send


def send_to_rank(rank, signal_number):
    def send(process):
        os.kill(rank_pid(process.pid, rank), signal_number)
        return f"{signal.Signals(signal_number).name} (rank {rank})"
    return send


base = ["--model", model, "--max-length", "128", "--log-every", "1"]
common = base + ["--max-steps", "24"]
sft_lora = common + ["--data", chat, "--lr", "1e-2", "--lora-rank", "8", "--lr-scheduler", "cosine",
                     "--warmup-steps", "2", "--save-steps", "5"]
sft_full = common + ["--data", chat, "--lr", "1e-3", "--full", "--weight-decay", "0.1", "--grad-accum", "2"]
dpo_lora = common + ["--data", pairs, "--lr", "1e-2", "--lora-rank", "8"]

stop_and_resume("sft-lora-sigterm", "sft", sft_lora, send_to(signal.SIGTERM))
stop_and_resume("sft-full-sigusr1", "sft", sft_full, send_to(signal.SIGUSR1), full=True)
stop_and_resume("dpo-lora-sigint", "dpo", dpo_lora, send_to(signal.SIGINT))
two = ["--nproc-per-node", "2"]
stop_and_resume("sft-lora-sp2-launcher-sigterm", "sft", sft_lora + two + ["--sp", "2"], send_to(signal.SIGTERM))
stop_and_resume("sft-full-dp2-rank1-sigusr1", "sft", sft_full + two, send_to_rank(1, signal.SIGUSR1), full=True)

# SIGKILL of the launcher (its ranks die with it), then --resume from the last --save-steps checkpoint.
what = "sft-lora-dp2-sigkill"
whole, cut = os.path.join(work, what + "-whole"), os.path.join(work, what + "-cut")
args = sft_lora + two
if run("sft", args, whole).returncode != 0:
    failures.append(f"{what}: the uninterrupted run failed")
else:
    process = start("sft", args, cut)
    if wait_for_steps(process, cut, 7, what):
        process.kill()
        process.communicate()
        r = run("sft", args + ["--resume"], cut)
        if r.returncode != 0 or "resuming from" not in r.stderr:
            failures.append(f"{what}: the resumed run failed: {r.stderr[-800:]}")
        else:
            same_curve(what, cut, whole)
            same_weights(what, cut, whole, False)
    else:
        process.kill()
        process.communicate()

# A second signal stops at once: no checkpoint, the signal's own status.
for what, extra in [("second-signal-one-process", []), ("second-signal-launcher", two)]:
    out = os.path.join(work, what)
    # Two different signals back to back: both are delivered (two of one kind sent together may merge
    # into one), the second while the first still waits for a step of 16 rows to end.
    process = start("sft", base + ["--data", chat, "--max-steps", "400", "--full", "--grad-accum", "16"] + extra, out)
    if wait_for_steps(process, out, 2, what):
        process.send_signal(signal.SIGUSR1)
        process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    if process.returncode == EXIT_STOPPED_RESUMABLE or process.returncode == 0:
        failures.append(f"{what}: exit status {process.returncode}: a second signal must stop the run at once")
    if "at once" not in stderr:
        failures.append(f"{what}: no word of stopping at once: {stderr[-600:]}")
    if os.path.isdir(out) and any(name.startswith("checkpoint-") for name in os.listdir(out)):
        failures.append(f"{what}: a checkpoint was written after the second signal: {os.listdir(out)}")

for f in failures:
    print("FAIL:", f)
print("stop signals and exact resume:", "all passed" if not failures else f"{len(failures)} failed")
if not failures:
    subprocess.run(["rm", "-rf", work])
sys.exit(1 if failures else 0)
