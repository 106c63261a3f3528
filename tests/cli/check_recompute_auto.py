#!/usr/bin/env python3
"""`--recompute auto` (bench, sft, plan) on the CPU backend, with the device's memory given by
--device-memory: the choice is the setting predicted fastest (the step-time model, plan/step_cost.h)
whose planned peak fits (none when it fits; else keep-attention or all on the fewest first layers,
the others keeping everything; with offload on the fewest first layers that make it fit; the MLP in
token tiles only when nothing untiled fits), the run's measured peak stays within the budget, and a budget
nothing fits is refused before the step with the longest sequence that would fit. sft plans the LoRA
targets it will train, and auto is its default; dpo plans its own step (its micro-batches, a --ref-model).
`plan --max-seq --recompute auto` offloads as many layers as the host holds, and sparse checkpoints
come last."""
import json
import os
import subprocess
import sys
import tempfile

spindle, root = sys.argv[1], sys.argv[2]
qwen2 = os.path.join(root, "testdata", "hf", "qwen2")
failures = []
SEQ = 128


def run(cmd, ok=True):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if ok and p.returncode != 0:
        sys.exit(f"`{' '.join(cmd)}` failed:\n{p.stdout}{p.stderr}")
    return p


def check(ok, what):
    print(f"{'ok  ' if ok else 'FAIL'} {what}")
    if not ok:
        failures.append(what)


# Six layers, so that per-layer settings exist between the modes (only the config is read).
model = tempfile.mkdtemp(prefix="spindle-auto-")
with open(os.path.join(model, "config.json"), "w") as f:
    json.dump({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
               "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu"}, f)
common = ["--model", model, "--seq", str(SEQ), "--device", "cpu"]


def planned(recompute, layers=-1, offload=False, extra=(), offload_layers=-1, field="peak_allocated_bytes"):
    args = [spindle, "plan", "--bench-step", "--json", "--recompute", recompute] + common + list(extra)
    if layers >= 0:
        args += ["--recompute-layers", str(layers)]
    if offload:
        args += ["--offload", "activations", "--offload-layers", str(offload_layers)]
    return json.loads(run(args).stdout)["results"][0][field]


def bench_auto(budget, extra=()):
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "bench.json")
        p = run([spindle, "bench", "--threads", "1", "--steps", "1", "--warmup", "1", "--profile-steps", "0",
                 "--recompute", "auto", "--device-memory", str(budget), "--json-file", report] + common + list(extra),
                ok=False)
        if p.returncode != 0:
            return p, None
        with open(report) as f:
            return p, json.load(f)["results"][0]


none, ka, every = planned("none"), planned("keep-attention"), planned("all")
all_offloaded = planned("all", offload=True)
check(none > ka > every > all_offloaded,
      f"planned peaks fall from none {none} to keep-attention {ka}, all {every}, all offloaded {all_offloaded}")

# Enough for everything: no recompute, the fastest.
p, r = bench_auto(none)
check(r is not None and r["recompute"] == "none" and r["peak_allocated_bytes"] <= none,
      f"budget {none}: none chosen, measured {r and r['peak_allocated_bytes']} ({p.stderr.strip()[-200:]})")

# A byte less: keep-attention on the fewest first layers that fit (fewer FLOPs than any 'all').
p, r = bench_auto(none - 1)
if r is None:
    check(False, f"budget {none - 1}: bench failed: {p.stderr}")
else:
    n = r["recompute_layers"] if r["recompute_layers"] >= 0 else 6
    got = planned(r["recompute"], r["recompute_layers"])
    fewer = planned(r["recompute"], n - 1) if n > 1 else none
    check(r["recompute"] == "keep-attention" and r["offload"] == "none" and got <= none - 1 < fewer
          and r["peak_allocated_bytes"] <= none - 1,
          f"budget {none - 1}: {r['recompute']} on {n} layers (plan {got}; one layer fewer plans {fewer}), "
          f"measured {r['peak_allocated_bytes']}")

# Between keep-attention and all, with no host memory for offload: 'all' on some layers, as
# keep-attention everywhere is out. (With host memory, keep-attention with offload may be predicted
# faster: the ranking follows the step-time model, tests/plan/test_step_cost.cpp.)
budget = (ka + every) // 2
p, r = bench_auto(budget, ["--host-memory", "4"])
check(r is not None and r["recompute"] == "all" and r["offload"] == "none" and r["peak_allocated_bytes"] <= budget,
      f"budget {budget}: {r and (r['recompute'], r['recompute_layers'])}, measured {r and r['peak_allocated_bytes']}")

# Below every setting without offload: all, offloaded to host memory.
budget = (every + all_offloaded) // 2
p, r = bench_auto(budget)
check(r is not None and r["offload"] == "activations" and r["peak_allocated_bytes"] <= budget
      and r["offload_host_bytes"] > 0,
      f"budget {budget}: {r and (r['recompute'], r['recompute_layers'], r['offload'])}, measured "
      f"{r and r['peak_allocated_bytes']} with {r and r['offload_host_bytes']} host bytes")
# ... on the fewest first layers that fit: one layer fewer does not.
if r is not None and r["offload"] == "activations":
    m = r["offload_layers"]
    n = r["recompute_layers"] if r["recompute_layers"] >= 0 else 6
    offloaded = m if m >= 0 else min(n, 5)
    fewer = (planned(r["recompute"], r["recompute_layers"], True, offload_layers=offloaded - 1) if offloaded > 1
             else planned(r["recompute"], r["recompute_layers"]))
    check(fewer > budget and planned(r["recompute"], r["recompute_layers"], True, offload_layers=m) <= budget,
          f"budget {budget}: offload on the first {offloaded} layers; {offloaded - 1} plan {fewer} bytes")
    check(r["offload_copy_bytes"] > 0 and r["offload_copy_gb_per_s"] > 0 and r["offload_wait_ms"] > 0,
          f"bench --json reports offload's copies: {r['offload_copy_bytes']} bytes per step at "
          f"{r['offload_copy_gb_per_s']} GB/s, {r['offload_wait_ms']} ms waited")

# plan --recompute auto says the same as bench.
doc = json.loads(run([spindle, "plan", "--bench-step", "--json", "--recompute", "auto", "--device-memory",
                      str(budget)] + common).stdout)
res = doc["results"][0]
check(res["offload_chosen"] == "activations" and res["peak_allocated_bytes"] <= budget,
      f"plan --recompute auto at {budget}: {res['recompute_chosen']} {res['recompute_layers_chosen']} "
      f"{res['offload_chosen']}, {res['peak_allocated_bytes']} bytes")

# --host-memory (bench, sft, dpo): the host offload may use three quarters of. With 4 bytes no setting
# offloads: the same budget runs without offload (sparse checkpoints, say) or is refused.
offload_budget = (every + all_offloaded) // 2
with tempfile.TemporaryDirectory() as tmp:
    report = os.path.join(tmp, "bench.json")
    p = run([spindle, "bench", "--threads", "1", "--steps", "1", "--warmup", "0", "--profile-steps", "0",
             "--recompute", "auto", "--device-memory", str(offload_budget), "--host-memory", "4", "--json-file",
             report] + common, ok=False)
    r = json.load(open(report))["results"][0] if p.returncode == 0 else None
    check((r is not None and r["offload"] == "none" and r["peak_allocated_bytes"] <= offload_budget)
          or (p.returncode != 0 and "no setting fits" in p.stderr),
          f"bench --host-memory 4 at {offload_budget}: {r and (r['recompute'], r['offload'], r['checkpoint_stride'])} "
          f"({p.stderr.strip().splitlines()[-1:]})")
p = run([spindle, "bench", "--recompute", "all", "--host-memory", "64GiB"] + common, ok=False)
check(p.returncode != 0 and "--host-memory" in p.stderr and "--recompute auto" in p.stderr,
      f"bench --host-memory without auto is refused ({p.stderr.strip().splitlines()[-1:]})")

# Nothing fits: refused before the step, naming the longest length that would.
p, r = bench_auto(all_offloaded * 3 // 4)
check(p.returncode != 0 and "--seq" in p.stderr and "no setting fits" in p.stderr and "Traceback" not in p.stderr
      and "tokens/s" not in p.stderr, f"too small a budget is refused: {p.stderr.strip().splitlines()[-1:]}")
p = run([spindle, "plan", "--recompute", "auto", "--device-memory", "12 bytes"] + common, ok=False)
check(p.returncode != 0 and "--device-memory" in p.stderr, "a bad --device-memory is refused")

# A wide MLP (intermediate 16 x hidden): below what every untiled setting needs, the MLP in token tiles
# (--mlp-tile-tokens auto lets the choice tile) with the fewest FLOPs that fits; a tile size given
# is kept. The tiles are 16384 tokens, more than the row: the saving is the kept layers' gate and up
# and the backward's fewer whole-row intermediates.
wide = tempfile.mkdtemp(prefix="spindle-auto-wide-")
with open(os.path.join(wide, "config.json"), "w") as f:
    json.dump({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 512,
               "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu"}, f)
wide_common = ["--model", wide, "--seq", str(SEQ), "--device", "cpu"]
wide_untiled = json.loads(run([spindle, "plan", "--bench-step", "--json", "--recompute", "all", "--offload",
                               "activations"] + wide_common).stdout)["results"][0]["peak_allocated_bytes"]
wide_tiled = json.loads(run([spindle, "plan", "--bench-step", "--json", "--recompute", "all", "--offload",
                             "activations", "--mlp-tile-tokens", "16k"] + wide_common).stdout)["results"][0][
    "peak_allocated_bytes"]
check(wide_tiled < wide_untiled, f"wide MLP: tiles plan {wide_tiled} bytes, untiled {wide_untiled}")
budget = (wide_tiled + wide_untiled) // 2
with tempfile.TemporaryDirectory() as tmp:
    report = os.path.join(tmp, "bench.json")
    p = run([spindle, "bench", "--threads", "1", "--steps", "1", "--warmup", "1", "--profile-steps", "0",
             "--recompute", "auto", "--device-memory", str(budget), "--json-file", report] + wide_common, ok=False)
    r = None
    if p.returncode == 0:
        with open(report) as f:
            r = json.load(f)["results"][0]
    check(r is not None and r["mlp_tile_tokens"] == 16384 and r["peak_allocated_bytes"] <= budget
          and "16384-token tiles" in p.stderr,
          f"wide MLP, budget {budget}: {r and (r['recompute'], r['recompute_layers'], r['offload'], r['mlp_tile_tokens'])}"
          f", measured {r and r['peak_allocated_bytes']} ({p.stderr.strip()[-300:]})")
    p = run([spindle, "bench", "--threads", "1", "--steps", "1", "--warmup", "0", "--profile-steps", "0",
             "--recompute", "auto", "--mlp-tile-tokens", "0", "--device-memory", str(budget)] + wide_common, ok=False)
    check(p.returncode != 0 and "no setting fits" in p.stderr,
          f"wide MLP, budget {budget}, --mlp-tile-tokens 0: refused ({p.stderr.strip().splitlines()[-1:]})")

# Offload competes on what it costs: its copies hide under the compute of a real model's layers, so an
# offloading setting that recomputes less comes before one that recomputes more without offload. On an
# H200, Qwen2.5-1.5B at 64k in 21.5 GiB ran 15,860 tok/s with all on 27 layers (the choice when offload
# came last) and 18,481 with keep-attention and offload (plan only here: the CUDA plan of the config).
doc = json.loads(run([spindle, "plan", "--bench-step", "--json", "--model", os.path.join(root, "configs", "qwen2.5-1.5b.json"),
                      "--seq", "64k", "--recompute", "auto", "--device-memory", "21.5GiB", "--host-memory", "128GiB"]).stdout)
res = doc["results"][0]
check(res["recompute_chosen"] == "keep-attention" and res["offload_chosen"] == "activations"
      and res["peak_allocated_bytes"] <= doc["usable_memory_bytes"],
      f"Qwen2.5-1.5B 64k in 21.5 GiB: {res['recompute_chosen']} on {res['recompute_layers_chosen']} layers, offload "
      f"{res['offload_chosen']} on {res['offload_layers_chosen']}, {res['peak_allocated_bytes']} bytes")

# plan --max-seq --recompute auto: recompute all (and tiles where they help), offload on as many first
# layers as the host holds and the other layers' kept tensors on the device. With a host too small for
# every layer's tensors it reaches longer rows than offloading all of them or none.
def max_seq(extra, host):
    out = run([spindle, "plan", "--json", "--bench-step", "--max-seq", "--model", model, "--device", "cpu",
               "--device-memory", str(budget_dev), "--host-memory", str(host)] + extra).stdout
    return json.loads(out)


budget_dev = planned("all", offload=True, extra=["--mlp-tile-tokens", "0"]) * 8
host_all = planned("all", offload=True, extra=["--mlp-tile-tokens", "0"], field="offload_host_bytes") * 8
for host in (host_all * 4 // 3 * 2 // 3, host_all * 4 // 3 // 2):  # two thirds / half of what 8x the row needs
    auto = max_seq(["--recompute", "auto", "--mlp-tile-tokens", "0"], host)
    whole = max_seq(["--recompute", "all", "--offload", "activations", "--mlp-tile-tokens", "0"], host)
    none_off = max_seq(["--recompute", "all", "--mlp-tile-tokens", "0"], host)
    check(auto["max_seq"] > max(whole["max_seq"], none_off["max_seq"]) and 0 <= auto["offload_layers"] < 5
          and auto["peak_allocated_bytes"] <= budget_dev and auto["offload_host_bytes"] <= host // 4 * 3,
          f"--max-seq with host {host}: auto {auto['max_seq']} (offload on the first {auto['offload_layers']} layers, "
          f"{auto['peak_allocated_bytes']} + {auto['offload_host_bytes']} host bytes), every layer offloaded "
          f"{whole['max_seq']}, none {none_off['max_seq']}")

# Sparse checkpoints come last: with a host too small for any offload (--host-memory 4 bytes) and
# a device below recompute all, auto keeps every 2nd layer's input (the cheapest stride that fits).
every_untiled = planned("all", extra=["--mlp-tile-tokens", "0"])
stride2 = planned("all", extra=["--mlp-tile-tokens", "0", "--checkpoint-stride", "2"])
check(stride2 < every_untiled, f"every 2nd layer's input plans {stride2} bytes, every layer's {every_untiled}")
budget = (stride2 + every_untiled) // 2
doc = json.loads(run([spindle, "plan", "--bench-step", "--json", "--recompute", "auto", "--mlp-tile-tokens", "0",
                      "--device-memory", str(budget), "--host-memory", "4"] + common).stdout)
res = doc["results"][0]
check(res["recompute_chosen"] == "all" and res["checkpoint_stride_chosen"] == 2 and res["offload_chosen"] == "none"
      and res["peak_allocated_bytes"] <= budget,
      f"budget {budget}, no host memory: {res['recompute_chosen']}, stride {res['checkpoint_stride_chosen']}, "
      f"offload {res['offload_chosen']}, {res['peak_allocated_bytes']} bytes")
# plan --max-seq --recompute auto also tries sparse checkpoints: with little host memory they reach further.
auto = max_seq(["--recompute", "auto", "--mlp-tile-tokens", "0"], host_all // 8)
check(auto["max_seq"] > auto["max_seq_every_input_kept"] and auto["checkpoint_stride"] > 1
      and auto["peak_allocated_bytes"] <= budget_dev,
      f"--max-seq with host {host_all // 8}: {auto['max_seq']} keeping one input in {auto['checkpoint_stride']}, "
      f"{auto['max_seq_every_input_kept']} keeping every one")

# sft: the choice from the plan of its rows (--max-length) with the AdamW state, and its peak within.
with tempfile.TemporaryDirectory() as tmp:
    base = [spindle, "plan", "--json", "--model", qwen2, "--seq", "32", "--device", "cpu", "--lora-rank", "4"]
    sft_none = json.loads(run(base + ["--recompute", "none"]).stdout)["results"][0]["peak_allocated_bytes"]
    budget = sft_none - 1
    p = run([spindle, "sft", "--model", qwen2, "--data", os.path.join(qwen2, "data.jsonl"), "--output",
             os.path.join(tmp, "out"), "--max-steps", "2", "--lr", "0.01", "--lora-rank", "4", "--max-length", "32",
             "--threads", "1", "--device", "cpu", "--recompute", "auto", "--device-memory", str(budget)], ok=False)
    peaks = []
    if p.returncode == 0:
        with open(os.path.join(tmp, "out", "metrics.jsonl")) as f:
            peaks = [json.loads(line)["peak_memory"] for line in f]
    check(p.returncode == 0 and "--recompute auto: " in p.stderr and "none" not in p.stderr.split("--recompute auto: ")[1][:5]
          and peaks and max(peaks) <= budget,
          f"sft --recompute auto at {budget} bytes: peaks {peaks} ({p.stderr.strip().splitlines()[:2]})")

# sft --recompute auto plans the adapters it trains (--lora-targets): a budget that LoRA on q_proj alone
# fits without recompute runs without (LoRA on every projection would need recompute there).
with tempfile.TemporaryDirectory() as tmp:
    base = [spindle, "plan", "--json", "--model", qwen2, "--seq", "32", "--device", "cpu", "--lora-rank", "4",
            "--recompute", "none"]
    q_only = json.loads(run(base + ["--lora-targets", "q_proj"]).stdout)["results"][0]["peak_allocated_bytes"]
    every = json.loads(run(base).stdout)["results"][0]["peak_allocated_bytes"]
    p = run([spindle, "sft", "--model", qwen2, "--data", os.path.join(qwen2, "data.jsonl"), "--output",
             os.path.join(tmp, "out"), "--max-steps", "1", "--lr", "0.01", "--lora-rank", "4", "--max-length", "32",
             "--lora-targets", "q_proj", "--threads", "1", "--device", "cpu", "--recompute", "auto",
             "--device-memory", str(q_only)], ok=False)
    peaks = []
    if p.returncode == 0:
        with open(os.path.join(tmp, "out", "metrics.jsonl")) as f:
            peaks = [json.loads(line)["peak_memory"] for line in f]
    check(every > q_only and p.returncode == 0 and "--recompute auto: none " in p.stderr and peaks
          and max(peaks) <= q_only,
          f"sft --lora-targets q_proj --recompute auto at {q_only} bytes (every projection: {every}): peaks {peaks} "
          f"({p.stderr.strip().splitlines()[:2]})")

# auto is sft's default: without --recompute the same budget gets a recomputing choice too; with
# --recompute-layers but no mode the run is refused before training, naming the modes to choose.
with tempfile.TemporaryDirectory() as tmp:
    base = [spindle, "sft", "--model", qwen2, "--data", os.path.join(qwen2, "data.jsonl"), "--max-steps", "1",
            "--lr", "0.01", "--lora-rank", "4", "--max-length", "32", "--threads", "1", "--device", "cpu"]
    p = run(base + ["--output", os.path.join(tmp, "default"), "--device-memory", str(budget)], ok=False)
    check(p.returncode == 0 and "--recompute auto: " in p.stderr
          and "none" not in p.stderr.split("--recompute auto: ")[1][:5],
          f"sft without --recompute at {budget} bytes plans as auto ({p.stderr.strip().splitlines()[:1]})")
    p = run(base + ["--output", os.path.join(tmp, "layers"), "--recompute-layers", "2"], ok=False)
    check(p.returncode != 0 and "--recompute-layers is chosen by --recompute auto" in p.stderr
          and not os.path.exists(os.path.join(tmp, "layers", "metrics.jsonl")),
          f"sft --recompute-layers without a mode is refused ({p.stderr.strip().splitlines()[-1:]})")

# dpo: its step planned as sft's plus what it holds beyond (every micro-batch of the optimizer step
# laid out at once, the backward's own per-token weights, a --ref-model beside the policy); with
# --recompute auto each step's measured peak stays within the budget. A tiny llama with the demo's
# tokenizer trains on text pairs (as tests/parallel_parity/dpo_parity.py builds them).
sys.path.insert(0, os.path.join(root, "tests", "support"))
from tiny_model import config as tiny_config, write_model  # noqa: E402

with tempfile.TemporaryDirectory() as tmp:
    dpo_model = os.path.join(tmp, "model")
    write_model(dpo_model, tiny_config(num_hidden_layers=4), tokenizer_dir=os.path.join(root, "demo", "tokenizer"))
    ref_model = os.path.join(tmp, "reference")
    write_model(ref_model, tiny_config(num_hidden_layers=4), seed=2, tokenizer_dir=os.path.join(root, "demo", "tokenizer"))
    pairs = os.path.join(tmp, "pairs.jsonl")
    with open(pairs, "w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": f"What is {i} plus {i}?", "chosen": f"It is {2 * i}. " * (1 + i % 3),
                                "rejected": f"It is {2 * i + 1}." * (1 + i % 2)}) + "\n")
    dpo_plan = [spindle, "plan", "--json", "--model", dpo_model, "--seq", "64", "--device", "cpu", "--lora-rank", "4"]

    def peak(extra):
        return json.loads(run(dpo_plan + extra).stdout)["results"][0]["peak_allocated_bytes"]

    sft_none, dpo_none = peak(["--recompute", "none"]), peak(["--recompute", "none", "--dpo", "--grad-accum", "2"])
    with_ref = peak(["--recompute", "none", "--dpo", "--grad-accum", "2", "--ref-model", ref_model])
    ref_doc = json.loads(run(dpo_plan + ["--recompute", "none", "--dpo", "--grad-accum", "2", "--ref-model",
                                         ref_model]).stdout)
    ref_weights = ref_doc["results"][0]["ranks"][0]["parts"].get("reference model", 0)
    check(sft_none < dpo_none < with_ref and with_ref - dpo_none == ref_weights > 0,
          f"plan --dpo: sft {sft_none}, dpo with 2 micro-batches {dpo_none}, with --ref-model {with_ref} "
          f"(the reference's weights {ref_weights})")

    def dpo(name, extra):
        out = os.path.join(tmp, name)
        p = run([spindle, "dpo", "--model", dpo_model, "--data", pairs, "--output", out, "--max-steps", "3",
                 "--lr", "0.01", "--lora-rank", "4", "--max-length", "64", "--grad-accum", "2", "--threads", "1",
                 "--device", "cpu"] + extra, ok=False)
        peaks = []
        if p.returncode == 0:
            with open(os.path.join(out, "metrics.jsonl")) as f:
                peaks = [json.loads(line)["peak_memory"] for line in f]
        return p, peaks

    # Two processes (sp 2, FSDP): each rank's shard of the rows, the reference sharded like the policy.
    sp2 = ["--nproc-per-node", "2", "--sp", "2"]
    sp2_ref = json.loads(run(dpo_plan + ["--recompute", "none", "--dpo", "--grad-accum", "2", "--ref-model", ref_model,
                                         "--world", "2", "--sp", "2"]).stdout)["results"][0]["peak_allocated_bytes"]
    for name, extra, budget in (("lora", [], dpo_none - 1),
                                ("ref-model", ["--ref-model", ref_model], with_ref - 1),
                                ("ref-model sp 2", ["--ref-model", ref_model] + sp2, sp2_ref - 1)):
        p, peaks = dpo(name, ["--recompute", "auto", "--device-memory", str(budget)] + extra)
        chosen = p.stderr.split("--recompute auto: ")[1][:40] if "--recompute auto: " in p.stderr else ""
        check(p.returncode == 0 and chosen and not chosen.startswith("none") and peaks and max(peaks) <= budget,
              f"dpo {name} --recompute auto at {budget} bytes: {chosen!r}, peaks {peaks} "
              f"({p.stderr.strip().splitlines()[-1:]})")

# sft with --offload activations: the same losses as without, the host memory in metrics.jsonl.
with tempfile.TemporaryDirectory() as tmp:
    def sft(name, extra):
        p = run([spindle, "sft", "--model", qwen2, "--data", os.path.join(qwen2, "data.jsonl"), "--output",
                 os.path.join(tmp, name), "--max-steps", "3", "--lr", "0.01", "--lora-rank", "4", "--max-length", "32",
                 "--threads", "1", "--device", "cpu", "--recompute", "all"] + extra)
        with open(os.path.join(tmp, name, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f], p.stderr
    plain, _ = sft("plain", [])
    moved, log = sft("offload", ["--offload", "activations"])
    check([m["loss"] for m in moved] == [m["loss"] for m in plain] and all(m.get("offload_host_memory", 0) > 0
                                                                          for m in moved)
          and all("offload_host_memory" not in m for m in plain),
          f"sft --offload activations: losses {[m['loss'] for m in moved]} (without: {[m['loss'] for m in plain]}), "
          f"host bytes {[m.get('offload_host_memory') for m in moved]}")
    # The copies of each step: out and back, timed (on the CPU their time is the time they add).
    check(all(m["offload_copy_bytes"] > 0 and m["offload_copy_s"] > 0 and m["offload_wait_s"] == m["offload_copy_s"]
              for m in moved) and "GB/s" in log,
          f"sft --offload activations: copies per step {[(m.get('offload_copy_bytes'), m.get('offload_copy_s')) for m in moved]}"
          f" ({[line for line in log.splitlines() if 'host' in line][:1]})")
    # Sparse checkpoints (layer 1 of 2 regenerated from layer 0's offloaded input): the same losses.
    sparse, _ = sft("stride", ["--checkpoint-stride", "2", "--offload", "activations"])
    check([m["loss"] for m in sparse] == [m["loss"] for m in plain],
          f"sft --checkpoint-stride 2 with offload: losses {[m['loss'] for m in sparse]} "
          f"(every input kept: {[m['loss'] for m in plain]})")
    for bad, needle in ((["--recompute", "keep-attention", "--checkpoint-stride", "2"], "--recompute all"),
                        (["--recompute", "auto", "--checkpoint-stride", "2"], "chosen by --recompute auto")):
        p = run([spindle, "sft", "--model", qwen2, "--data", os.path.join(qwen2, "data.jsonl"), "--output",
                 os.path.join(tmp, "bad"), "--max-steps", "1", "--threads", "1", "--device", "cpu"] + bad, ok=False)
        check(p.returncode != 0 and needle in p.stderr and not os.path.exists(os.path.join(tmp, "bad", "metrics.jsonl")),
              f"sft {' '.join(bad)} is refused ({p.stderr.strip().splitlines()[-1:]})")

sys.exit(f"{len(failures)} failed: {failures}" if failures else 0)
