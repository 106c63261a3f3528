#!/usr/bin/env python3
"""`spindle plan` predicts what `spindle bench` measures: on the CPU backend the peak of live tensor
bytes of a training step, for every model family (mixture-of-experts ones with the router aux loss
on and off), LoRA and full fine-tuning, each recompute mode, packed rows, and sequence-parallel
meshes of CPU processes (rank 0's peak, as bench reports it).
The prediction must be within 5 % of the measurement (it is exact when both count the same
allocations). Also: bad options are errors before anything is planned."""
import json
import os
import subprocess
import sys
import tempfile

spindle, root = sys.argv[1], sys.argv[2]
hf = os.path.join(root, "testdata", "hf")


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        sys.exit(f"`{' '.join(cmd)}` failed:\n{p.stdout}{p.stderr}")
    return p.stdout


def measured(model, seq, extra, mesh):
    """bench's peak of live device tensors and the host bytes of offload at their peak (rank 0)."""
    world = ["--nproc-per-node", str(mesh[0])] + mesh[1] if mesh[0] > 1 else []
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "bench.json")
        run([spindle, "bench", "--device", "cpu", "--threads", "1", "--model", model, "--seq", str(seq),
             "--steps", "1", "--warmup", "1", "--profile-steps", "0", "--json-file", report] + world + extra)
        with open(report) as f:
            result = json.load(f)["results"][0]
            return result["peak_allocated_bytes"], result["offload_host_bytes"]


def predicted(model, seq, extra, mesh):
    world = ["--world", str(mesh[0])] + mesh[1]
    doc = json.loads(run([spindle, "plan", "--device", "cpu", "--bench-step", "--model", model, "--seq", str(seq),
                          "--json"] + world + extra))
    ranks = doc["results"][0]["ranks"]
    return ranks[0]["peak_allocated_bytes"], ranks[0]["peak_phase"], ranks[0]["host_peak_bytes"]


cases = [
    ("qwen3 LoRA, recompute all", "qwen3", 96, ["--lora-rank", "4", "--recompute", "all"], (1, [])),
    ("qwen3 LoRA, no recompute", "qwen3", 96, ["--lora-rank", "4", "--recompute", "none"], (1, [])),
    ("qwen2 full, keep-attention", "qwen2", 128, ["--full", "--recompute", "keep-attention"], (1, [])),
    ("llama LoRA, recompute on the first of 2 layers", "llama", 64, ["--recompute", "all", "--recompute-layers", "1"],
     (1, [])),
    ("qwen2 packed rows of 16", "qwen2", 96, ["--doc-length", "16", "--recompute", "none"], (1, [])),
    ("qwen3 Ulysses sp 2 (FSDP over 2)", "qwen3", 96, ["--lora-rank", "4"], (2, ["--sp", "2", "--ulysses", "2"])),
    ("qwen2 ring sp 2, full", "qwen2", 96, ["--full", "--recompute", "none"], (2, ["--sp", "2", "--ring", "2"])),
]
# 4-bit base weights (QLoRA): packed bytes and absmax (FSDP shards them as bytes), the per-projection
# dequantisation scratch of the step.
cases += [
    ("qwen2 NF4 LoRA, recompute all", "qwen2", 96, ["--quantize", "nf4", "--recompute", "all"], (1, [])),
    ("qwen3 NF4 double quantisation, blocksize 32, no recompute", "qwen3", 96,
     ["--quantize", "nf4", "--double-quant", "--quant-block-size", "32", "--recompute", "none"], (1, [])),
    ("llama FP4 keep-attention", "llama", 64, ["--quantize", "fp4", "--recompute", "keep-attention"], (1, [])),
    ("qwen2 NF4 Ulysses sp 2 (FSDP over 2)", "qwen2", 96, ["--quantize", "nf4", "--double-quant"],
     (2, ["--sp", "2", "--ulysses", "2"])),
    ("qwen3 NF4 dp 2 (FSDP over 2)", "qwen3", 96, ["--quantize", "nf4", "--recompute", "none"], (2, [])),
]
# Activation offload: the device's peak without what went to host memory (host bytes compared below).
offload_cases = [
    ("qwen2 offload, recompute all", "qwen2", 96, ["--recompute", "all", "--offload", "activations"], (1, [])),
    ("qwen3 offload, keep-attention", "qwen3", 96, ["--recompute", "keep-attention", "--offload", "activations"],
     (1, [])),
    ("llama offload, keep-attention on the first layer, NF4", "llama", 64,
     ["--recompute", "keep-attention", "--recompute-layers", "1", "--offload", "activations", "--quantize", "nf4"],
     (1, [])),
    ("qwen3 offload, Ulysses sp 2", "qwen3", 96, ["--recompute", "all", "--offload", "activations"],
     (2, ["--sp", "2", "--ulysses", "2"])),
]
# Partial offload (--offload-layers): the first layers' kept tensors in host memory, the later layers'
# on the device. A five-layer model (the config alone) so that some offloadable layers stay; with
# per-layer recompute, keep-attention, the MLP in tiles, sequence parallelism, and the hybrid MoE model.
deep = tempfile.mkdtemp(prefix="spindle-plan-deep-")
with open(os.path.join(deep, "config.json"), "w") as f:
    json.dump({"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
               "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu"}, f)
offload_cases += [
    ("5 layers, offload of the first 2, recompute all", deep, 96,
     ["--recompute", "all", "--offload", "activations", "--offload-layers", "2"], (1, [])),
    ("5 layers, offload of the first layer, keep-attention, full", deep, 96,
     ["--full", "--recompute", "keep-attention", "--offload", "activations", "--offload-layers", "1"], (1, [])),
    ("5 layers, recompute on the first 4, offload of the first 3", deep, 64,
     ["--recompute", "all", "--recompute-layers", "4", "--offload", "activations", "--offload-layers", "3"], (1, [])),
    ("5 layers, offload of no layer (--offload-layers 0)", deep, 64,
     ["--recompute", "all", "--offload", "activations", "--offload-layers", "0"], (1, [])),
    ("5 layers, offload of the first 2, MLP in 40-token tiles, Ulysses sp 2", deep, 96,
     ["--recompute", "all", "--offload", "activations", "--offload-layers", "2", "--mlp-tile-tokens", "40"],
     (2, ["--sp", "2", "--ulysses", "2"])),
    ("qwen3_5_moe (text) offload of the first of 3 layers, recompute all", "qwen3_5_moe_text", 64,
     ["--recompute", "all", "--offload", "activations", "--offload-layers", "1"], (1, [])),
]
cases += offload_cases
# SwiGLU MLPs in token tiles: one tile's intermediates, gate and up recomputed in backward; tiles that
# divide the row's tokens and that do not, with offload, and under sequence parallelism.
cases += [
    ("qwen2 LoRA, MLP in 40-token tiles, recompute all", "qwen2", 96,
     ["--recompute", "all", "--mlp-tile-tokens", "40"], (1, [])),
    ("qwen3 full, MLP in 32-token tiles, no recompute", "qwen3", 96,
     ["--full", "--recompute", "none", "--mlp-tile-tokens", "32"], (1, [])),
    ("llama MLP in 16-token tiles, offload, keep-attention", "llama", 64,
     ["--recompute", "keep-attention", "--offload", "activations", "--mlp-tile-tokens", "16"], (1, [])),
    ("qwen3 MLP in 20-token tiles, Ulysses sp 2", "qwen3", 96, ["--recompute", "all", "--mlp-tile-tokens", "20"],
     (2, ["--sp", "2", "--ulysses", "2"])),
]

# A hybrid model (gated DeltaNet and gated attention layers): the config alone is enough for both.
hybrid = tempfile.mkdtemp(prefix="spindle-plan-")
with open(os.path.join(hybrid, "config.json"), "w") as f:
    json.dump({"model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
               "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
               "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
               "layer_types": ["linear_attention", "full_attention", "linear_attention"],
               "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
               "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.5}, f)
cases += [("qwen3_5 (DeltaNet + gated attention) LoRA, recompute all", hybrid, 96, ["--recompute", "all"], (1, [])),
          ("qwen3_5 full, keep-attention", hybrid, 64, ["--full", "--recompute", "keep-attention"], (1, []))]

# Mixture-of-experts layers: the buffers are sized by the T·k routed rows whatever the router picks
# (grouped expert GEMMs); 4-bit experts run per expert on the plan's balanced routing. The tiny
# checkpoints' configs turn the router load-balancing loss on (output_router_logits), in bench as in
# sft; qwen3_moe has a dense MLP layer between its MoE layers, qwen3_5_moe adds the shared expert,
# DeltaNet and gated attention.
cases += [
    ("qwen3_moe LoRA, recompute all, aux loss on", "qwen3_moe", 96, ["--recompute", "all"], (1, [])),
    ("qwen3_moe full, no recompute, aux loss off", "qwen3_moe", 96,
     ["--full", "--recompute", "none", "--router-aux-loss-coef", "0"], (1, [])),
    ("qwen3_moe NF4 experts (per-expert path), keep-attention", "qwen3_moe", 64,
     ["--quantize", "nf4", "--recompute", "keep-attention"], (1, [])),
    ("qwen3_moe LoRA on the routed experts and q_proj, no recompute", "qwen3_moe", 96,
     ["--lora-targets", "q_proj", "experts", "--recompute", "none"], (1, [])),
    ("qwen3_5_moe (text) LoRA on experts.down_proj over NF4 experts, recompute all", "qwen3_5_moe_text", 64,
     ["--lora-targets", "experts.down_proj", "--quantize", "nf4", "--recompute", "all"], (1, [])),
    ("qwen3_5_moe (text) LoRA, keep-attention, aux loss on", "qwen3_5_moe_text", 96, ["--recompute", "keep-attention"],
     (1, [])),
    ("qwen3_5_moe (multimodal config) full, recompute all", "qwen3_5_moe", 64, ["--full", "--recompute", "all"],
     (1, [])),
    ("qwen3_5_moe (text) offload, recompute all", "qwen3_5_moe_text", 64,
     ["--recompute", "all", "--offload", "activations"], (1, [])),
    ("qwen3_5_moe (text) Ulysses sp 2 (FSDP over 2), aux loss on", "qwen3_5_moe_text", 96,
     ["--recompute", "all"], (2, ["--sp", "2", "--ulysses", "2"])),
    # The DeltaNet state passing plans its pieces from every rank's document ids and positions on the
    # host: the plan simulates the sp ranks side by side and moves those values between them.
    ("qwen3_5_moe (text) ring sp 2 (DeltaNet state passing), full", "qwen3_5_moe_text", 96,
     ["--full", "--recompute", "none"], (2, ["--sp", "2", "--ring", "2"])),
    ("qwen3_5_moe (text) sp 4 = Ulysses 2 x ring 2 (state passing inside Ulysses), LoRA", "qwen3_5_moe_text", 128,
     ["--recompute", "all"], (4, ["--sp", "4", "--ulysses", "2", "--ring", "2"])),
    # qwen3_next: the fused DeltaNet projections' outputs regrouped through per-call buffers, a dense layer.
    ("qwen3_next LoRA on in_proj_qkvz and in_proj_ba, recompute all", "qwen3_next", 96,
     ["--lora-targets", "in_proj_qkvz", "in_proj_ba", "q_proj", "--recompute", "all"], (1, [])),
    ("qwen3_next ring sp 2, full, no recompute", "qwen3_next", 96, ["--full", "--recompute", "none"],
     (2, ["--sp", "2", "--ring", "2"])),
]
# glm4_moe: a dense first layer, then routed experts behind the sigmoid router (its correction biases are
# F32 buffers of the layer, never trained: no gradient or optimizer state) and ungated shared experts.
cases += [
    ("glm4_moe LoRA, recompute all", "glm4_moe", 96, ["--recompute", "all"], (1, [])),
    ("glm4_moe full, no recompute", "glm4_moe", 96, ["--full", "--recompute", "none"], (1, [])),
    ("glm4_moe LoRA on the routed experts and q_proj, keep-attention", "glm4_moe", 64,
     ["--lora-targets", "q_proj", "experts", "--recompute", "keep-attention"], (1, [])),
    ("glm4_moe Ulysses sp 2 (FSDP over 2), full", "glm4_moe", 96, ["--full", "--recompute", "all"],
     (2, ["--sp", "2", "--ulysses", "2"])),
]
# phi3: the fused qkv_proj and gate_up_proj (their outputs split, their gradients put together again, LoRA
# on them), LongRoPE's tables per document, a window, partial rotary and a tied head (phi3_lora's config).
cases += [
    ("phi3 LoRA on the fused projections, recompute all", "phi3", 96, ["--recompute", "all"], (1, [])),
    ("phi3 (partial rotary, tied) full, MLP in 40-token tiles, keep-attention", "phi3_lora", 96,
     ["--full", "--recompute", "keep-attention", "--mlp-tile-tokens", "40"], (1, [])),
    ("phi3 ring sp 2, packed rows of 20, no recompute", "phi3", 96, ["--doc-length", "20", "--recompute", "none"],
     (2, ["--sp", "2", "--ring", "2"])),
]
# Sparse checkpoints (--checkpoint-stride): every Nth layer keeps its input, the others regenerated
# at the top of their group in backward; with offload of the checkpoints, tiles, sequence
# parallelism (FSDP's forward windows inside the backward) and the hybrid MoE model.
cases += [
    ("5 layers, every 2nd layer's input kept", deep, 96, ["--recompute", "all", "--checkpoint-stride", "2"], (1, [])),
    ("5 layers, every 3rd layer's input kept, checkpoints offloaded", deep, 96,
     ["--recompute", "all", "--checkpoint-stride", "3", "--offload", "activations"], (1, [])),
    ("5 layers, every 2nd, first 2 offloaded, MLP in 40-token tiles, Ulysses sp 2", deep, 96,
     ["--recompute", "all", "--checkpoint-stride", "2", "--offload", "activations", "--offload-layers", "2",
      "--mlp-tile-tokens", "40"], (2, ["--sp", "2", "--ulysses", "2"])),
    ("qwen3_5_moe (text) every 2nd of 3 layers' input kept", "qwen3_5_moe_text", 64,
     ["--recompute", "all", "--checkpoint-stride", "2"], (1, [])),
]

failures = []
for name, model, seq, extra, mesh in cases:
    path = os.path.join(hf, model)
    want, want_host = measured(path, seq, extra, mesh)
    got, phase, got_host = predicted(path, seq, extra, mesh)
    rel = abs(got - want) / want
    ok = rel <= 0.05
    offloads = "--offload" in extra and extra[extra.index("--offload") + 1] == "activations" and not (
        "--offload-layers" in extra and extra[extra.index("--offload-layers") + 1] == "0")
    if offloads:  # the host side of offload: planned as the CPU backend allocates it
        host_rel = abs(got_host - want_host) / max(want_host, 1)
        ok = ok and want_host > 0 and host_rel <= 0.05
    elif want_host != 0 or got_host != 0:
        ok = False
    host = f"; host {got_host} planned, {want_host} measured" if offloads else ""
    print(f"{'ok  ' if ok else 'FAIL'} {name}: plan {got} bytes (peak in {phase}), bench {want} bytes, "
          f"error {100 * rel:.2f} %{host}")
    if not ok:
        failures.append(name)

for bad, needle in ((["--world", "3", "--sp", "2"], "--sp"), (["--seq", "0"], "--seq"),
                    (["--device", "tpu"], "--device"), (["--dtype", "bf16", "--device", "cpu"], "bf16"),
                    (["--dtype", "f64"], "f64"), (["--router-aux-loss-coef", "0.01"], "mixture-of-experts"),
                    (["--recompute", "none", "--recompute-layers", "1"], "--recompute-layers"),
                    (["--recompute", "none", "--offload", "activations"], "--offload"),
                    (["--offload", "disk"], "--offload"), (["--quantize", "nf8"], "--quantize"),
                    (["--offload-layers", "2"], "--offload activations"),
                    (["--offload", "activations", "--offload-layers", "-2"], "--offload-layers"),
                    (["--recompute", "auto", "--offload", "activations", "--offload-layers", "2"], "--offload-layers"),
                    (["--full", "--quantize", "nf4"], "4-bit"),
                    (["--recompute", "keep-attention", "--checkpoint-stride", "2"], "--recompute all"),
                    (["--checkpoint-stride", "0"], "--checkpoint-stride"),
                    (["--recompute", "auto", "--checkpoint-stride", "2"], "--checkpoint-stride")):
    model = ["--model", os.path.join(hf, "qwen2")]
    p = subprocess.run([spindle, "plan"] + model + bad,
                       capture_output=True, text=True, timeout=60)
    ok = p.returncode != 0 and needle in p.stderr and "Traceback" not in p.stderr
    print(f"{'ok  ' if ok else 'FAIL'} refuses {' '.join(bad)}: {p.stderr.strip().splitlines()[-1] if p.stderr else ''}")
    if not ok:
        failures.append(" ".join(bad))

# glm4_moe has no router aux loss in transformers: the flag is refused, naming the family.
p = subprocess.run([spindle, "plan", "--model", os.path.join(hf, "glm4_moe"), "--router-aux-loss-coef", "0.01"],
                   capture_output=True, text=True, timeout=60)
ok = p.returncode != 0 and "no router auxiliary loss for glm4_moe" in p.stderr and "Traceback" not in p.stderr
print(f"{'ok  ' if ok else 'FAIL'} refuses --router-aux-loss-coef on glm4_moe: "
      f"{p.stderr.strip().splitlines()[-1] if p.stderr else ''}")
if not ok:
    failures.append("glm4_moe --router-aux-loss-coef")

p = subprocess.run([spindle, "plan", "--model", os.path.join(hf, "qwen2"), "--mlp-tile-tokens", "lots"],
                   capture_output=True, text=True, timeout=60)
ok = p.returncode != 0 and "--mlp-tile-tokens" in p.stderr and "Traceback" not in p.stderr
print(f"{'ok  ' if ok else 'FAIL'} refuses --mlp-tile-tokens lots: {p.stderr.strip().splitlines()[-1] if p.stderr else ''}")
if not ok:
    failures.append("--mlp-tile-tokens lots")

sys.exit(f"{len(failures)} failed: {failures}" if failures else 0)
