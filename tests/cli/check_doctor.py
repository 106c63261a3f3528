#!/usr/bin/env python3
"""`spindle doctor` explains this machine: its text and --json agree, a machine without a GPU is
said to be one and still exits 0, the launcher's variables (torchrun, SLURM) are read as a run
would read them, and malformed ones are an error (exit 1) with the variable named. Exit status: 1
exactly when a problem is an error."""
import json
import os
import subprocess
import sys

spindle, root = sys.argv[1], sys.argv[2]
failures = []
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
            "SPINDLE_STORE_PORT")


def doctor(extra_env=None, json_output=False):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER and not k.startswith("SLURM_")}
    env.update(extra_env or {})
    args = [spindle, "doctor"] + (["--json"] if json_output else [])
    return subprocess.run(args, capture_output=True, text=True, env=env)


def check(condition, message):
    print(("ok: " if condition else "FAILED: ") + message)
    if not condition:
        failures.append(message)


def report(extra_env=None):
    out = doctor(extra_env, json_output=True)
    try:
        return out.returncode, json.loads(out.stdout)
    except json.JSONDecodeError:
        failures.append(f"--json printed no JSON (exit {out.returncode}): {out.stdout[:300]} {out.stderr[:300]}")
        return out.returncode, None


def errors(doc):
    return [p for p in doc["problems"] if p["severity"] == "error"]


text = doctor()
rc, doc = report()
if doc is None:
    sys.exit(1)
for key in ("spindle", "gpus", "cuda", "libraries", "host", "launcher", "data", "problems", "ok"):
    check(key in doc, f"--json has '{key}'")
check(rc == text.returncode, f"text and --json exit alike ({text.returncode}, {rc})")
check(rc == (1 if errors(doc) else 0) and doc["ok"] == (rc == 0), "exit 1 exactly when a problem is an error")
for p in doc["problems"]:
    check(p["severity"] in ("error", "warning", "note") and p["what"] and p["fix"], f"problem has a fix: {p['what'][:60]}")
    check(p["what"] in text.stdout,
          f"the text shows the problem: {p['what'][:60]}")
for section in ("GPUs", "CUDA", "Host", "Launcher", "Data"):
    check(f"\n{section}\n" in text.stdout, f"the text has a {section} section")
check(doc["host"]["memory_bytes"] > 0 and doc["host"]["cpus"] > 0, "host memory and cores are reported")
check("cgroup" in doc["host"] and "memory_limit_bytes" in doc["host"]["cgroup"], "the control group's cap is reported")
version = subprocess.run([spindle, "--version"], capture_output=True, text=True).stdout
check(doc["spindle"]["build"] in version, "the build features are --version's")
check(doc["data"]["parquet"]["available"] == ("Parquet/Arrow" in version),
      "Parquet support is reported as the build has it")

if not doc["gpus"]:
    # A machine without a GPU (CI): said clearly, a note rather than an error, exit 0.
    check(rc == 0, "no GPU: exit 0")
    check("none visible" in text.stdout and "CPU backend" in text.stdout, "no GPU: the text says so and names the CPU backend")
    check(any(p["severity"] == "note" and p["what"].startswith("no GPU") for p in doc["problems"]),
          "no GPU: a note with its fix")
    check(doc.get("gpu_status"), "no GPU: why is in the JSON")
else:
    for gpu in doc["gpus"]:
        check(gpu["compute_capability"] and gpu["memory_bytes"] > 0, f"GPU {gpu['index']}: {gpu['name']} described")
        check(gpu["supported"] or any(f"GPU {gpu['index']} " in p["what"] for p in errors(doc)),
              f"GPU {gpu['index']}: unsupported means an error naming it")
    check(doc["cuda"]["driver"] and doc["cuda"]["runtime"], "driver and runtime versions are reported")

# torchrun's variables.
rc2, d = report({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0",
                 "MASTER_PORT": "29500", "NCCL_DEBUG": "INFO"})
if d:
    launcher = d["launcher"]
    check(launcher.get("rank") == 1 and launcher.get("world_size") == 2 and launcher.get("local_rank") == 1
          and launcher.get("master_addr") == "node0", f"torchrun variables read as rank 1 of 2: {launcher}")
    check(launcher["variables"].get("NCCL_DEBUG") == "INFO", "NCCL_* variables are listed")
    check(rc2 == rc, "a consistent launcher changes nothing else")
# SLURM's, as srun sets them.
rc3, d = report({"SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
                 "SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "2(x2)",
                 "SLURM_JOB_NODELIST": "gpu[07-08]"})
if d:
    launcher = d["launcher"]
    check(launcher.get("rank") == 3 and launcher.get("world_size") == 4 and launcher.get("local_rank") == 1
          and launcher.get("master_addr") == "gpu07", f"SLURM variables read as rank 3 of 4 on gpu07: {launcher}")
# Inside a SLURM allocation without srun.
_, d = report({"SLURM_JOB_ID": "4242"})
if d:
    check(any("not started by srun" in p["what"] for p in d["problems"]), "salloc without srun: a note")
# Malformed: an error naming the variable, exit 1.
bad = doctor({"RANK": "0", "WORLD_SIZE": "abc"})
rc4, d = report({"RANK": "0", "WORLD_SIZE": "abc"})
check(bad.returncode == 1 and rc4 == 1, f"malformed WORLD_SIZE: exit 1 (got {bad.returncode}, {rc4})")
check("WORLD_SIZE='abc'" in bad.stdout and "cannot run" in bad.stdout, "malformed WORLD_SIZE: the text names it")
if d:
    check(any("WORLD_SIZE" in p["what"] for p in errors(d)), "malformed WORLD_SIZE: an error in the JSON")
sys.exit(1 if failures else 0)
