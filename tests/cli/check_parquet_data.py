#!/usr/bin/env python3
"""Parquet and cached hub datasets train as JSONL does: `spindle sft` on the same rows as a JSONL
file, a Parquet file, a folder of Parquet shards, a dataset in a fake hub cache (`--data ORG/NAME`)
and in a fake `datasets` Arrow cache gives the same losses and gradient norms, step for step. A
dataset in neither cache is refused before any work with the download command.

The files are written by pyarrow. Without it (or without Parquet support in this build) the test is
skipped (exit 77), unless SPINDLE_TEST_REQUIRE_PARQUET=1 or SPINDLE_TEST_REQUIRE_DATA=1 (CI)."""
import json
import os
import subprocess
import sys
import tempfile

spindle, root = sys.argv[1], sys.argv[2]
case = os.path.join(root, "testdata", "hf", "qwen2")
strict = "1" in (os.environ.get("SPINDLE_TEST_REQUIRE_PARQUET"), os.environ.get("SPINDLE_TEST_REQUIRE_DATA"))


def skip(reason):
    if strict:
        print(f"FAILED: {reason} (SPINDLE_TEST_REQUIRE_PARQUET=1: it must be there)")
        sys.exit(1)
    print(f"SKIPPED: {reason}")
    sys.exit(77)


try:
    import pyarrow as pa
    import pyarrow.parquet as pq
except ImportError:
    skip("python3 has no pyarrow (python3 -m pip install pyarrow) to write the test files")
doctor = json.loads(subprocess.run([spindle, "doctor", "--json"], capture_output=True, text=True).stdout)
if not doctor["data"]["parquet"]["available"]:
    skip("this spindle cannot read Parquet: " + " ".join(p["what"] for p in doctor["problems"] if "Parquet" in p["what"]))

failures = []


def check(condition, message):
    print(("ok: " if condition else "FAILED: ") + message)
    if not condition:
        failures.append(message)


rows = [json.loads(line) for line in open(os.path.join(case, "data.jsonl")) if line.strip()]
table = pa.Table.from_pylist(rows)

with tempfile.TemporaryDirectory() as tmp:
    os.makedirs(os.path.join(tmp, "runs"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update({"HF_HUB_CACHE": os.path.join(tmp, "hub"), "HF_DATASETS_CACHE": os.path.join(tmp, "datasets")})
    # A Parquet file, a folder of shards, the hub cache's layout and the datasets cache's.
    pq.write_table(table, os.path.join(tmp, "train.parquet"))
    os.makedirs(os.path.join(tmp, "shards"))
    half = table.num_rows // 2
    pq.write_table(table.slice(0, half), os.path.join(tmp, "shards", "part-0.parquet"))
    pq.write_table(table.slice(half), os.path.join(tmp, "shards", "part-1.parquet"))
    repo = os.path.join(tmp, "hub", "datasets--Org--Tiny")
    commit = "0123456789abcdef0123456789abcdef01234567"
    os.makedirs(os.path.join(repo, "blobs"))
    os.makedirs(os.path.join(repo, "refs"))
    os.makedirs(os.path.join(repo, "snapshots", commit, "data"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    for i, part in enumerate((table.slice(0, half), table.slice(half))):
        blob = os.path.join(repo, "blobs", f"blob{i}")
        pq.write_table(part, blob)
        os.symlink(f"../../../blobs/blob{i}", os.path.join(repo, "snapshots", commit, "data", f"train-0000{i}-of-00002.parquet"))
    prepared = os.path.join(tmp, "datasets", "Org___Cached", "default", "0.0.0", "abcdef")
    os.makedirs(prepared)
    with pa.OSFile(os.path.join(prepared, "cached-train.arrow"), "wb") as f:
        with pa.ipc.new_stream(f, table.schema) as w:
            for batch in table.to_batches(max_chunksize=3):
                w.write_batch(batch)
    with open(os.path.join(prepared, "dataset_info.json"), "w") as f:
        json.dump({"splits": {"train": {"name": "train", "num_examples": table.num_rows}}}, f)

    def sft(data, output):
        return subprocess.run([spindle, "sft", "--model", case, "--data", data, "--output", os.path.join(tmp, "runs", output),
                               "--max-steps", "3", "--lr", "0.01", "--lora-rank", "4", "--max-length", "32",
                               "--threads", "1", "--seed", "3"],
                              capture_output=True, text=True, env=env, cwd=tmp)

    def trajectory(output):
        with open(os.path.join(tmp, "runs", output, "metrics.jsonl")) as f:
            return [(m["loss"], m["grad_norm"]) for m in map(json.loads, f) if "loss" in m]

    reference = sft(os.path.join(case, "data.jsonl"), "jsonl")
    check(reference.returncode == 0, "sft on JSONL runs" + ("" if reference.returncode == 0 else reference.stderr[-300:]))
    for data, output in ((os.path.join(tmp, "train.parquet"), "parquet"), (os.path.join(tmp, "shards"), "shards"),
                         ("Org/Tiny", "hub"), ("Org/Tiny:train", "hub_split"), ("Org/Cached", "datasets_cache")):
        run = sft(data, output)
        check(run.returncode == 0, f"sft --data {data} runs" + ("" if run.returncode == 0 else ": " + run.stderr[-400:]))
        if run.returncode == 0 and reference.returncode == 0:
            check(trajectory(output) == trajectory("jsonl"), f"--data {data}: the losses and gradient norms of JSONL")
    # Resuming the hub run: the data is identified by its contents, found again.
    resumed = subprocess.run([spindle, "sft", "--model", case, "--data", "Org/Tiny", "--output", os.path.join(tmp, "runs", "hub"),
                              "--max-steps", "4", "--lr", "0.01", "--lora-rank", "4", "--max-length", "32",
                              "--threads", "1", "--seed", "3", "--resume"], capture_output=True, text=True, env=env)
    check(resumed.returncode == 0 and len(trajectory("hub")) == 4,
          "--resume of a hub-dataset run" + ("" if resumed.returncode == 0 else ": " + resumed.stderr[-300:]))
    # Not in any cache: refused before any work, with the download command.
    missing = sft("Org/Absent", "absent")
    check(missing.returncode == 2 and "huggingface-cli download Org/Absent --repo-type dataset" in missing.stderr
          and not os.path.exists(os.path.join(tmp, "runs", "absent")),
          f"a dataset in neither cache is refused with the download command: {missing.stderr.strip()[-300:]}")
    # spindle prepare reads a split of a hub dataset too.
    prep = subprocess.run([spindle, "prepare", "--data", "Org/Tiny:train", "--output", os.path.join(tmp, "prepared"),
                           "--max-length", "32"],
                          capture_output=True, text=True, env=env)
    check(prep.returncode == 0 and "rows" in prep.stdout + prep.stderr,
          "spindle prepare --data Org/Tiny:train" + ("" if prep.returncode == 0 else ": " + prep.stderr[-300:]))

sys.exit(1 if failures else 0)
