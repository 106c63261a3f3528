#!/usr/bin/env python3
"""The sequence-parallel parity matrix (docs/design.md §2), on CPU processes.

Each case runs `spindle check`: the first global batch of a job on a mesh of real processes against
one process with plain attention; in F32 the loss and every gradient tensor within 5 times their own
F32 rounding (measured by check against the same step in F64), in F64 within 1e-10 and 1e-9. A tiny GQA model (4 query heads, 2 KV heads: Ulysses 4 replicates KV
heads) is trained fully, so every weight has a gradient.

The full product sp {1,2,4} x {ulysses, ring, hybrid} x dp {1,2} x grad-accum {1,2} x packing x
loss_scale has 96 cases (sp 8 runs its hybrid and ring splits once, dp 1). Pruned, because the
factors act on different code:
  - the attention strategy and the layout depend on sp/ulysses/ring only, so every strategy runs at
    every degree with dp 1 and dp 2, with packing, loss_scale and grad-accum 2 on (the hardest setting);
  - grad-accum, packing and loss_scale change the rows and weights, not the strategy: each is turned
    off one at a time on the strategies that shard differently (contiguous, zigzag, hybrid);
  - --recompute all and keep-attention run once or twice each (part lora), on HF-made models.
The data holds a document shorter than the ranks (2-3 tokens), one supervised only in its first
tokens (all its targets fall on the first rank), and rows whose later shards have no supervised target.

The qlora part runs LoRA over 4-bit (bitsandbytes NF4/FP4) base weights, quantised at load or read
from a folder bitsandbytes saved, with FSDP sharding the packed bytes and absmax.

The gdn part runs a tiny qwen3_5 (gated DeltaNet layers with slow-decay heads, gated attention over 2
KV heads) on every kind of mesh up to sp 8: DeltaNet heads over Ulysses, the recurrent state passed
from rank to rank (ring, hybrid, a Ulysses degree that does not divide the DeltaNet key heads); and a tiny
qwen3_next (the same layers with the DeltaNet projections fused per key head, experts, a dense layer).

The gpt_oss part runs a tiny gpt_oss (sinks, a sliding window crossing the shards, the biased router and
clamped-SwiGLU experts, the load-balancing loss) on Ulysses, ring and hybrid meshes.

The glm4_moe part runs a tiny glm4_moe (partial RoPE, q/k norms and q/k/v biases, a dense first layer, the
sigmoid router with correction biases that move the choice and group-limited top-k, ungated shared experts;
no aux loss, which transformers does not define for it) at sp 1, 2 and 4 on Ulysses, ring and hybrid meshes
with dp 1 and 2, and LoRA on every projection and the routed experts.

The phi3 part runs a tiny phi3 (fused qkv_proj and gate_up_proj, a sliding window, LongRoPE on 0.75 of each
head with an original window of 12 that most documents pass) and a llama with dynamic NTK (its base grown for
documents past 16 tokens) on every kind of mesh: a document cut over several ranks must rotate with the
table of its whole length on each of them, never its shard's.

usage: parity_matrix.py SPINDLE ROOT PART   (PART: sp2, sp4, sp8, dp, variants, lora, qlora, moe, gdn, wave2,
       gpt_oss, glm4_moe, phi3, sft, errors)
"""
import json
import os
import random
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
from tiny_model import (config, gemma2_config, gemma3_text_config, glm4_moe_config, gpt_oss_config,  # noqa: E402
                        mistral_config, phi3_config, qwen3_5_config, qwen3_moe_config, qwen3_next_config, write_model)

spindle, root, part = sys.argv[1], sys.argv[2], sys.argv[3]
work = tempfile.mkdtemp(prefix=f"spindle-parity-{part}-")


def make_data(path, loss_scale, vocab=64, seed=2):
    rng = random.Random(seed)
    docs = []
    # (length, which targets are supervised)
    shapes = [(30, "tail"), (3, "all"), (20, "head"), (17, "all"), (2, "all"), (25, "middle"),
              (11, "all"), (26, "head"), (9, "tail"), (14, "all"), (5, "all"), (22, "middle")]
    for n, kind in shapes:
        ids = [rng.randrange(vocab) for _ in range(n)]
        sup = {"all": lambda i: True, "head": lambda i: 1 <= i <= 4, "tail": lambda i: i >= n - 8,
               "middle": lambda i: n // 3 <= i < 2 * n // 3}[kind]
        labels = [ids[i] if sup(i) and i > 0 else -100 for i in range(n)]
        doc = {"input_ids": ids, "labels": labels}
        if loss_scale:
            doc["loss_scale"] = [round(rng.uniform(0.25, 2.0), 3) for _ in range(n)]
        docs.append(doc)
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")


model = os.path.join(work, "model")
write_model(model, config())
# qwen3_moe: layers 0 and 2 route each token to 2 of 4 experts, layer 1 is dense.
moe_model = os.path.join(work, "moe")
write_model(moe_model, qwen3_moe_config())
# qwen3_5: gated DeltaNet (2 key heads, 4 value heads), gated attention (4 query heads over 2 KV
# heads), gated DeltaNet; every DeltaNet head decays slowly (exp(g) ≈ 0.9995: A_log −5, dt_bias −3),
# so a state lost or leaked at a rank boundary or a document start shows in every later token.
hybrid_model = os.path.join(work, "qwen3_5")
write_model(hybrid_model, qwen3_5_config())
# gpt_oss: a sliding layer (window 5: it crosses shard and zigzag chunk boundaries) and a full one, sinks
# N(0, 1) on both, biased attention, a biased router and biased clamped-SwiGLU experts in every layer.
gpt_oss_model = os.path.join(work, "gpt_oss")
write_model(gpt_oss_model, gpt_oss_config(sliding_window=5))


def slow_deltanet_decay(path):
    from safetensors.numpy import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for name in tensors:
        if name.endswith("linear_attn.A_log"):
            tensors[name][:] = -5.0
        elif name.endswith("linear_attn.dt_bias"):
            tensors[name][:] = -3.0
    save_file(tensors, file, metadata={"format": "pt"})


slow_deltanet_decay(hybrid_model)
data_scaled = os.path.join(work, "scaled.jsonl")
data_plain = os.path.join(work, "plain.jsonl")
make_data(data_scaled, True)
make_data(data_plain, False)


# Tolerances per compute dtype. F32: none given, so `spindle check` measures the rounding of the
# one-process step against the same step in F64 and holds the mesh to a small multiple of it (the
# result of a different summation order depends on the BLAS kernels: AVX2, AVX-512, Intel, AMD).
# F64 leaves only its own rounding, far below any defect.
TOLERANCES = {"f32": (), "f64": ("--loss-tolerance", "1e-10", "--grad-tolerance", "1e-9")}


def check(name, sp=1, ulysses=None, ring=None, dp=1, accum=2, packing=True, scaled=True, model_dir=model,
          extra=(), dtype="f32"):
    cmd = [spindle, "check", "--model", model_dir, "--data", data_scaled if scaled else data_plain,
           "--max-length", "48", "--grad-accum", str(accum), "--sp", str(sp), "--dp", str(dp),
           "--nproc-per-node", str(sp * dp), "--json", *TOLERANCES[dtype], "--threads", "1", "--dtype", dtype]
    if ulysses:
        cmd += ["--ulysses", str(ulysses)]
    if ring:
        cmd += ["--ring", str(ring)]
    if not packing:
        cmd.append("--no-packing")
    cmd += list(extra) or ["--full"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [l for l in out.stdout.splitlines() if l.lstrip("[rank 0] ").startswith("{")]
    if not lines:
        print(f"FAIL {name}: exit {out.returncode}\n{out.stderr[-3000:]}")
        return False
    r = json.loads(lines[-1].split("] ", 1)[-1])
    ok = out.returncode == 0 and r["passed"] and r["num_items"] > 0
    aux = ""
    if "--router-aux-loss-coef" in extra:  # the aux loss must have been computed, on both sides
        ok &= "aux_loss_single" in r and r["aux_loss_single"] > 0
        aux = f", aux loss {r.get('aux_loss_single', float('nan')):.6f} rel {r.get('aux_loss_relative_error', 1):.1e}"
    ok &= r["rounding_measured"] == (dtype == "f32")
    print(f"{'ok  ' if ok else 'FAIL'} {name}: dp {r['dp']} sp {r['sp']} (u{r['ulysses']} r{r['ring']}) "
          f"rows {r['rows']} targets {r['num_items']}: loss rel {r['loss_relative_error']:.1e}{aux}, "
          f"worst grad rel {r['worst_relative_error']:.1e} of {r['worst_tolerance']:.1e} allowed "
          f"({r['worst_excess']:.2f}; {r['worst_tensor']})")
    return ok


def run_sft(out, nproc, extra, lr="1e-2"):
    if "--max-steps" not in extra:
        extra = extra + ["--max-steps", "3"]
    cmd = [spindle, "sft", "--model", model, "--data", data_scaled, "--output", out, "--max-length", "48",
           "--lr", lr, "--full", "--threads", "1", "--log-every", "100",
           "--nproc-per-node", str(nproc)] + extra
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        print(f"FAIL: {' '.join(cmd)}\n{p.stderr[-3000:]}")
        return None
    return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]


results = []
if part == "sp2":
    for dp in (1, 2):
        results.append(check(f"ulysses sp2 dp{dp}", sp=2, ulysses=2, dp=dp))
        results.append(check(f"ring sp2 dp{dp}", sp=2, ring=2, dp=dp))
elif part == "sp4":
    for dp in (1, 2):
        results.append(check(f"ulysses sp4 (KV heads replicated) dp{dp}", sp=4, ulysses=4, dp=dp))
        results.append(check(f"ring sp4 dp{dp}", sp=4, ring=4, dp=dp))
        results.append(check(f"hybrid u2 x r2 dp{dp}", sp=4, ulysses=2, ring=2, dp=dp))
elif part == "sp8":
    # sp 8, the largest mesh of an 8-GPU host, on 8 CPU processes: both hybrid splits and pure
    # ring (pure Ulysses 8 would need 8 query heads; the model has 4).
    results.append(check("hybrid u2 x r4", sp=8, ulysses=2, ring=4))
    results.append(check("hybrid u4 x r2 (KV heads replicated)", sp=8, ulysses=4, ring=2))
    results.append(check("ring sp8", sp=8, ring=8))
elif part == "dp":
    results.append(check("sp1 dp1 (the runner without a mesh)", sp=1, dp=1))
    results.append(check("sp1 dp2", sp=1, dp=2))
elif part == "variants":
    for mesh in ({"sp": 2, "ulysses": 2}, {"sp": 2, "ring": 2}, {"sp": 4, "ulysses": 2, "ring": 2}):
        label = f"sp{mesh['sp']} u{mesh.get('ulysses', 1)} r{mesh.get('ring', 1)}"
        results.append(check(f"{label} grad-accum 1", accum=1, **mesh))
        results.append(check(f"{label} no packing", packing=False, **mesh))
        results.append(check(f"{label} no loss_scale", scaled=False, **mesh))
        results.append(check(f"{label} --no-fsdp (replicated weights)", extra=["--full", "--no-fsdp"], **mesh))
elif part == "lora":
    # LoRA with a trained adapter (B != 0) on HF-made qwen2 (q/k/v biases) and qwen3 (q/k norms), in
    # F64: qwen2_lora's attention is saturated, which makes its F32 gradients depend on the BLAS
    # kernels' summation order by more than 1e-5 (1.7e-5 with AVX-512 kernels, under 1e-5 with AVX2).
    for case in ("qwen2_lora", "qwen3"):
        d = os.path.join(root, "testdata", "hf", case)
        extra = ["--adapter", os.path.join(d, "adapter")] if os.path.isdir(os.path.join(d, "adapter")) else ["--full"]
        results.append(check(f"{case} hybrid u2 x r2", sp=4, ulysses=2, ring=2, model_dir=d, extra=extra,
                             dtype="f64"))
        results.append(check(f"{case} ring sp2 dp2 recompute", sp=2, ring=2, dp=2, model_dir=d,
                             extra=extra + ["--recompute", "all"], dtype="f64"))
        # Recompute around the kept attention output (no second attention forward), one strategy
        # per model; bit-identity with the other modes is tested in tests/model and tests/sp.
        mesh = {"ring": 2} if case == "qwen2_lora" else {"ulysses": 2}
        results.append(check(f"{case} {next(iter(mesh))} sp2 recompute keep-attention", sp=2, model_dir=d,
                             extra=extra + ["--recompute", "keep-attention"], dtype="f64", **mesh))
elif part == "qlora":
    # QLoRA: the base projections are 4-bit and frozen; FSDP shards their packed bytes and absmax
    # (default on), SP is unchanged. HF-made models with trained adapters (B != 0), in F64.
    def hf(case):
        d = os.path.join(root, "testdata", "hf", case)
        return d, ["--adapter", os.path.join(d, "adapter")]
    d, adapter = hf("qwen2_nf4")
    results.append(check("nf4 at load hybrid u2 x r2", sp=4, ulysses=2, ring=2, model_dir=d,
                         extra=adapter + ["--quantize", "nf4"], dtype="f64"))
    results.append(check("nf4 at load, double quant, ring sp2 dp2 recompute", sp=2, ring=2, dp=2, model_dir=d,
                         extra=adapter + ["--quantize", "nf4", "--double-quant", "--recompute", "all"], dtype="f64"))
    results.append(check("nf4 at load, blocksize 128, ulysses sp2 --no-fsdp", sp=2, ulysses=2, model_dir=d,
                         extra=adapter + ["--quantize", "nf4", "--quant-block-size", "128", "--no-fsdp"],
                         dtype="f64"))
    d, adapter = hf("qwen2_nf4_dq_saved")
    results.append(check("pre-quantised nf4 (double quant) ulysses sp4", sp=4, ulysses=4, model_dir=d, extra=adapter,
                         dtype="f64"))
    d, adapter = hf("llama_nf4_bf16_saved")
    results.append(check("pre-quantised nf4, bf16 storage, ring sp2 dp2", sp=2, ring=2, dp=2, model_dir=d,
                         extra=adapter, dtype="f64"))
    d, adapter = hf("llama_fp4_f32_saved")
    results.append(check("pre-quantised fp4, f32 storage, hybrid u2 x r2", sp=4, ulysses=2, ring=2,
                         model_dir=d, extra=adapter, dtype="f64"))
elif part == "sft":
    # Training itself: 3 optimizer steps at lr 1e-2 on 4 processes (sp 4) log the losses of one process.
    one = run_sft(os.path.join(work, "sft1"), 1, ["--grad-accum", "2"])
    four = run_sft(os.path.join(work, "sft4"), 4, ["--grad-accum", "2", "--sp", "4"])
    # Seed 001: dp2·sp2 against dp2·sp1 at lr 0 and the same global batch: the same loss every step.
    dp_sp = run_sft(os.path.join(work, "dp2sp2"), 4, ["--sp", "2"], lr="0")
    dp_only = run_sft(os.path.join(work, "dp2sp1"), 2, [], lr="0")
    # A checkpoint written on one mesh resumes on another: 2 steps at sp 4, then steps 3-4 at sp 2
    # (both FSDP), against 4 uninterrupted steps in one process (constant lr: the schedule does not
    # depend on --max-steps).
    const = ["--grad-accum", "2", "--lr-scheduler", "constant"]
    moved = os.path.join(work, "moved")
    first = run_sft(moved, 4, const + ["--sp", "4", "--max-steps", "2"])
    resumed = run_sft(moved, 2, const + ["--sp", "2", "--max-steps", "4", "--resume"])
    straight = run_sft(os.path.join(work, "straight"), 1, const + ["--max-steps", "4"])
    for name, a, b in (("sft sp4 vs one process", four, one), ("seed 001: dp2 sp2 vs dp2 sp1 at lr 0", dp_sp, dp_only),
                       ("resume sp4 -> sp2 vs one process", resumed, straight)):
        ok = a is not None and b is not None and len(a) == len(b) >= 3
        if ok:
            for x, y in zip(a, b):
                rel = abs(x["loss"] - y["loss"]) / abs(y["loss"])
                ok &= rel < 1e-5 and x["num_items"] == y["num_items"]
                print(f"  step {x['step']}: loss {x['loss']:.8f} vs {y['loss']:.8f} (rel {rel:.1e}), "
                      f"targets {x['num_items']} vs {y['num_items']}")
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
        results.append(ok)
elif part == "moe":
    # qwen3_moe with the router load-balancing loss, whose statistics are global over the step: every
    # sp shard, dp replica and micro-batch (grad-accum 2 computes them in a forward pass of their own;
    # grad-accum 1, inside the one micro-batch's step). Routing is per token, so every strategy shards
    # it alike; the experts and routers are FSDP-sharded like any weight.
    aux = ["--full", "--router-aux-loss-coef", "0.05"]
    results.append(check("moe sp1 dp2", dp=2, model_dir=moe_model, extra=aux))
    for dp in (1, 2):
        results.append(check(f"moe ulysses sp2 dp{dp}", sp=2, ulysses=2, dp=dp, model_dir=moe_model, extra=aux))
        results.append(check(f"moe ring sp2 dp{dp}", sp=2, ring=2, dp=dp, model_dir=moe_model, extra=aux))
    results.append(check("moe ulysses sp4 (KV heads replicated)", sp=4, ulysses=4, model_dir=moe_model, extra=aux))
    results.append(check("moe ring sp4", sp=4, ring=4, model_dir=moe_model, extra=aux))
    results.append(check("moe hybrid u2 x r2", sp=4, ulysses=2, ring=2, model_dir=moe_model, extra=aux))
    results.append(check("moe hybrid u2 x r2 grad-accum 1", sp=4, ulysses=2, ring=2, accum=1, model_dir=moe_model,
                         extra=aux))
    results.append(check("moe ring sp2 dp2 grad-accum 1 --no-fsdp", sp=2, ring=2, dp=2, accum=1, model_dir=moe_model,
                         extra=aux + ["--no-fsdp"]))
    results.append(check("moe ulysses sp2 recompute all, f64", sp=2, ulysses=2, model_dir=moe_model,
                         extra=aux + ["--recompute", "all"], dtype="f64"))
    results.append(check("moe ring sp2 recompute all, one input in 3, f64", sp=2, ring=2, model_dir=moe_model,
                         extra=aux + ["--recompute", "all", "--checkpoint-stride", "3"], dtype="f64"))
    # LoRA on what PEFT adapts in qwen3_moe (attention, the dense layer's MLP), experts frozen.
    results.append(check("moe LoRA ring sp2 dp2", sp=2, ring=2, dp=2, model_dir=moe_model,
                         extra=["--lora-rank", "4", "--router-aux-loss-coef", "0.05"]))
    # LoRA on the routed experts' fused tensors (PEFT's target_parameters): PEFT's adapter with nonzero B
    # over the per-expert checkpoint it was made for (its config turns the aux loss on), and new
    # adapters named on the command line; the pairs are FSDP-sharded with their layer.
    expert_lora = os.path.join(root, "testdata", "hf", "qwen3_moe_expert_lora")
    peft_adapter = ["--adapter", os.path.join(expert_lora, "adapter")]
    # F64: in this adapter's q_proj pairs F32 summation order alone moves the gradient by ~1e-5.
    results.append(check("moe expert LoRA (PEFT adapter) ulysses sp2, f64", sp=2, ulysses=2, model_dir=expert_lora,
                         extra=peft_adapter, dtype="f64"))
    results.append(check("moe expert LoRA (PEFT adapter) sp1 dp2", dp=2, model_dir=expert_lora, extra=peft_adapter))
    results.append(check("moe expert LoRA --lora-targets q_proj experts ring sp2 dp2", sp=2, ring=2, dp=2,
                         model_dir=moe_model, extra=["--lora-rank", "4", "--lora-targets", "q_proj", "experts",
                                                     "--router-aux-loss-coef", "0.05"]))
elif part == "gdn":
    # qwen3_5 (gated DeltaNet and gated attention layers) on every kind of mesh. Ulysses splits the
    # DeltaNet heads when its degree divides the 2 key heads; ring and hybrid pass the recurrent
    # state from rank to rank (zigzag shards: two pieces of each document per rank); ulysses 4
    # replicates attention's 2 KV heads and passes the DeltaNet state over the whole sp group.
    results.append(check("qwen3_5 ulysses sp2", sp=2, ulysses=2, model_dir=hybrid_model))
    results.append(check("qwen3_5 ring sp2 dp2", sp=2, ring=2, dp=2, model_dir=hybrid_model))
    results.append(check("qwen3_5 ring sp4", sp=4, ring=4, model_dir=hybrid_model))
    results.append(check("qwen3_5 hybrid u2 x r2", sp=4, ulysses=2, ring=2, model_dir=hybrid_model))
    results.append(check("qwen3_5 ulysses sp4 (DeltaNet state over sp)", sp=4, ulysses=4, model_dir=hybrid_model))
    results.append(check("qwen3_5 LoRA hybrid u2 x r2 grad-accum 1", sp=4, ulysses=2, ring=2, accum=1,
                         model_dir=hybrid_model, extra=["--lora-rank", "4"]))
    results.append(check("qwen3_5 ring sp2 recompute all, f64", sp=2, ring=2, model_dir=hybrid_model,
                         extra=["--full", "--recompute", "all"], dtype="f64"))
    # Sparse checkpoints: the regenerating forward passes the DeltaNet state between ranks again.
    results.append(check("qwen3_5 hybrid u2 x r2 recompute all, one input in 2, f64", sp=4, ulysses=2, ring=2,
                         model_dir=hybrid_model, extra=["--full", "--recompute", "all", "--checkpoint-stride", "2"],
                         dtype="f64"))
    # sp 8 on a model with 2 KV heads and 2 DeltaNet key heads: ulysses 2 (both head counts), ring 4.
    results.append(check("qwen3_5 hybrid u2 x r4 (sp8)", sp=8, ulysses=2, ring=4, model_dir=hybrid_model))
    # qwen3_next: the DeltaNet projections fused per key head, a dense middle layer, experts and a shared
    # expert with the load-balancing loss; LoRA on the fused projections.
    next_model = os.path.join(work, "qwen3_next")
    write_model(next_model, qwen3_next_config())
    slow_deltanet_decay(next_model)
    aux = ["--full", "--router-aux-loss-coef", "0.05"]
    results.append(check("qwen3_next ulysses sp2 dp2", sp=2, ulysses=2, dp=2, model_dir=next_model, extra=aux))
    results.append(check("qwen3_next hybrid u2 x r2", sp=4, ulysses=2, ring=2, model_dir=next_model, extra=aux))
    results.append(check("qwen3_next LoRA on in_proj_qkvz/in_proj_ba ring sp2", sp=2, ring=2, model_dir=next_model,
                         extra=["--lora-rank", "4", "--lora-targets", "in_proj_qkvz", "in_proj_ba", "q_proj"]))
elif part == "wave2":
    # Sliding windows (5 keys: they cross the shard and zigzag-chunk boundaries of 48-token rows),
    # soft-capped attention and final logits, sandwich norms, GeGLU, two RoPE tables, on every kind of
    # mesh. The ring exchanges every block; a query's window is cut by the shared visibility rule.
    mistral = os.path.join(work, "mistral")
    write_model(mistral, mistral_config())
    gemma2 = os.path.join(work, "gemma2")
    write_model(gemma2, gemma2_config())
    gemma3 = os.path.join(work, "gemma3")
    write_model(gemma3, gemma3_text_config())
    results.append(check("mistral ring sp4", sp=4, ring=4, model_dir=mistral))
    results.append(check("mistral ulysses sp2 dp2", sp=2, ulysses=2, dp=2, model_dir=mistral))
    results.append(check("mistral LoRA hybrid u2 x r2", sp=4, ulysses=2, ring=2, model_dir=mistral,
                         extra=["--lora-rank", "4"]))
    results.append(check("gemma2 hybrid u2 x r2", sp=4, ulysses=2, ring=2, model_dir=gemma2))
    results.append(check("gemma2 ring sp2 dp2 recompute all, f64", sp=2, ring=2, dp=2, model_dir=gemma2,
                         extra=["--full", "--recompute", "all"], dtype="f64"))
    results.append(check("gemma3 ulysses sp4 (KV heads replicated)", sp=4, ulysses=4, model_dir=gemma3))
    results.append(check("gemma3 ring sp8", sp=8, ring=8, model_dir=gemma3))
elif part == "gpt_oss":
    # gpt_oss with the load-balancing loss: the ring merges every key block before the sinks join a row's
    # denominator (once), the window crosses shard and zigzag boundaries, routing and the experts are per token.
    aux = ["--full", "--router-aux-loss-coef", "0.05"]
    results.append(check("gpt_oss ulysses sp2", sp=2, ulysses=2, model_dir=gpt_oss_model, extra=aux))
    results.append(check("gpt_oss ring sp2 dp2", sp=2, ring=2, dp=2, model_dir=gpt_oss_model, extra=aux))
    results.append(check("gpt_oss ring sp4", sp=4, ring=4, model_dir=gpt_oss_model, extra=aux))
    results.append(check("gpt_oss hybrid u2 x r2", sp=4, ulysses=2, ring=2, model_dir=gpt_oss_model, extra=aux))
    results.append(check("gpt_oss hybrid u2 x r2 grad-accum 1, f64", sp=4, ulysses=2, ring=2, accum=1,
                         model_dir=gpt_oss_model, extra=aux, dtype="f64"))
    results.append(check("gpt_oss ring sp2 recompute all, f64", sp=2, ring=2, model_dir=gpt_oss_model,
                         extra=aux + ["--recompute", "all"], dtype="f64"))
    # LoRA on the attention projections (the experts stay frozen; spindle adapts none of them).
    results.append(check("gpt_oss LoRA hybrid u2 x r2", sp=4, ulysses=2, ring=2, model_dir=gpt_oss_model,
                         extra=["--lora-rank", "4", "--router-aux-loss-coef", "0.05"]))
elif part == "glm4_moe":
    # glm4_moe: routing is per token (the correction biases and the group limit choose, the un-biased
    # sigmoid scores weigh), so every strategy shards it alike; the biases are FSDP-sharded buffers
    # that no rank trains. The dense first layer and the shared experts run on every token.
    glm4 = os.path.join(work, "glm4_moe")
    write_model(glm4, glm4_moe_config())
    results.append(check("glm4_moe sp1 dp2", dp=2, model_dir=glm4))
    for dp in (1, 2):
        results.append(check(f"glm4_moe ulysses sp2 dp{dp}", sp=2, ulysses=2, dp=dp, model_dir=glm4))
        results.append(check(f"glm4_moe ring sp2 dp{dp}", sp=2, ring=2, dp=dp, model_dir=glm4))
    results.append(check("glm4_moe ulysses sp4 (KV heads replicated)", sp=4, ulysses=4, model_dir=glm4))
    results.append(check("glm4_moe ring sp4", sp=4, ring=4, model_dir=glm4))
    results.append(check("glm4_moe hybrid u2 x r2", sp=4, ulysses=2, ring=2, model_dir=glm4))
    results.append(check("glm4_moe hybrid u2 x r2 grad-accum 1, no packing", sp=4, ulysses=2, ring=2, accum=1,
                         packing=False, model_dir=glm4))
    results.append(check("glm4_moe ring sp2 dp2 --no-fsdp", sp=2, ring=2, dp=2, model_dir=glm4,
                         extra=["--full", "--no-fsdp"]))
    results.append(check("glm4_moe ulysses sp2 recompute all, f64", sp=2, ulysses=2, model_dir=glm4,
                         extra=["--full", "--recompute", "all"], dtype="f64"))
    # LoRA on every projection (attention, the dense MLP, the shared experts) and the routed experts.
    lora = ["--lora-rank", "4", "--lora-targets", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
            "down_proj", "experts"]
    results.append(check("glm4_moe LoRA + expert LoRA hybrid u2 x r2", sp=4, ulysses=2, ring=2, model_dir=glm4,
                         extra=lora))
    results.append(check("glm4_moe LoRA + expert LoRA ring sp2 dp2", sp=2, ring=2, dp=2, model_dir=glm4, extra=lora))
elif part == "phi3":
    # LongRoPE and dynamic NTK choose a table per document from its whole length: documents of 2-30 tokens
    # on both sides of the windows (12 and 16), cut by the contiguous, zigzag and hybrid layouts of 48-token
    # rows; the fused projections (and LoRA on them: the default targets are qkv_proj, o_proj, gate_up_proj,
    # down_proj), the window of 6 crossing shard boundaries.
    phi3 = os.path.join(work, "phi3")
    write_model(phi3, phi3_config())
    dynamic = os.path.join(work, "dynamic")
    write_model(dynamic, config(max_position_embeddings=16, rope_scaling={"type": "dynamic", "factor": 2.0}))
    results.append(check("phi3 dp2", dp=2, model_dir=phi3))
    results.append(check("phi3 ulysses sp2 dp2", sp=2, ulysses=2, dp=2, model_dir=phi3))
    results.append(check("phi3 ulysses sp4 (KV heads replicated)", sp=4, ulysses=4, model_dir=phi3))
    results.append(check("phi3 ring sp4", sp=4, ring=4, model_dir=phi3))
    results.append(check("phi3 LoRA hybrid u2 x r2", sp=4, ulysses=2, ring=2, model_dir=phi3,
                         extra=["--lora-rank", "4"]))
    results.append(check("phi3 ring sp2 dp2 recompute all, f64", sp=2, ring=2, dp=2, model_dir=phi3,
                         extra=["--full", "--recompute", "all"], dtype="f64"))
    results.append(check("dynamic NTK ring sp4", sp=4, ring=4, model_dir=dynamic))
    results.append(check("dynamic NTK hybrid u2 x r2", sp=4, ulysses=2, ring=2, model_dir=dynamic))
    results.append(check("dynamic NTK ulysses sp2 dp2", sp=2, ulysses=2, dp=2, model_dir=dynamic))
elif part == "errors":
    # A wrong mesh is an error naming the flags, before anything is allocated.
    for args, expect in ((["--nproc-per-node", "2", "--sp", "3"], "--sp"),
                         (["--nproc-per-node", "4", "--sp", "4", "--ulysses", "3"], "--ulysses"),
                         (["--nproc-per-node", "2", "--sp", "2", "--dp", "2"], "--dp")):
        p = subprocess.run([spindle, "check", "--model", model, "--data", data_plain, "--full"] + args,
                           capture_output=True, text=True, timeout=120)
        ok = p.returncode != 0 and expect in p.stderr and "Traceback" not in p.stderr
        print(f"{'ok  ' if ok else 'FAIL'} {' '.join(args)} -> exit {p.returncode}: "
              f"{[l for l in p.stderr.splitlines() if 'error' in l][:1]}")
        results.append(ok)
else:
    sys.exit(f"unknown part {part}")

print(f"{sum(results)}/{len(results)} cases passed")
sys.exit(0 if results and all(results) else 1)
