#!/usr/bin/env python3
"""The Python peer of `spindle bench`: one training step of a Hugging Face model with random weights,
timed on the GPU host the way the users of the Python stacks run it (transformers + peft LoRA +
gradient checkpointing, bf16; optionally Liger kernels, cuDNN attention, bitsandbytes NF4 base).

Runs on the GPU host (PyTorch with CUDA, transformers, peft; liger-kernel and bitsandbytes only for
--liger / --quantize, carried as wheels: scripts/gpu/README.md). It prints one JSON line per
sequence length, the fields named as `spindle bench --json` names them where they mean the same:
  seq, tokens_per_s, step_ms (median of --steps timed steps), peak_allocated_bytes
  (torch.cuda.max_memory_allocated over the timed steps), peak_reserved_bytes, status ("ok" or
  "oom"), and the settings. A length that runs out of memory prints status "oom" and the next
  (longer) lengths are skipped.

Model: --config takes a config.json (configs/*.json). A multimodal config (text_config inside, e.g.
Qwen3.6's qwen3_5_moe) is reduced to its text tower, the model spindle trains. Weights are random
(the model's own initialiser); the input is one row of random token ids, labels = inputs.

Examples (from the repository root):
  python3 scripts/gpu/peer_hf.py --config configs/qwen2.5-7b.json --seq 32k,64k --liger --attn cudnn
  python3 scripts/gpu/peer_hf.py --config configs/qwen3.6-35b-a3b.json --seq 4k,16k,32k \
      --targets q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,out_proj
  python3 scripts/gpu/peer_hf.py --config configs/qwen2.5-7b.json --seq 8k,32k --quantize nf4 --double-quant
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile

import torch
import transformers

DENSE_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def parse_length(s):
    s = s.strip().lower()
    return int(s[:-1]) * 1024 if s.endswith("k") else int(s)


def text_config(path):
    """The transformers config of the text model a config.json describes (the text tower of a
    multimodal checkpoint: its model_type gets the `_text` suffix transformers registers)."""
    with open(path) as f:
        raw = json.load(f)
    if "text_config" in raw:
        text = dict(raw["text_config"])
        text.setdefault("model_type", raw["model_type"] + "_text")
        raw = text
    model_type = raw.pop("model_type")
    return transformers.AutoConfig.for_model(model_type, **raw)


def build_model(args, cfg):
    cfg.use_cache = False
    if args.attn != "cudnn":
        cfg._attn_implementation = args.attn
    else:
        cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    if args.quantize:
        # bitsandbytes quantises while loading a checkpoint: save the random bf16 model once, reload it 4-bit.
        import bitsandbytes  # noqa: F401  (fails early with a clear ImportError when the wheel is missing)
        folder = tempfile.mkdtemp(prefix="peer_hf_")
        with torch.device("cuda"):
            dense = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        dense.save_pretrained(folder)
        del dense
        torch.cuda.empty_cache()
        qc = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.quantize,
                                             bnb_4bit_use_double_quant=args.double_quant,
                                             bnb_4bit_compute_dtype=torch.bfloat16,
                                             bnb_4bit_quant_storage=torch.bfloat16)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=qc,
                                                                  dtype=torch.bfloat16, device_map={"": 0})
    else:
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    if args.liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        _apply_liger_kernel_to_instance(model=model)
    import peft
    lora = peft.LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
                           target_modules=args.targets.split(","), bias="none")
    model = peft.get_peft_model(model, lora)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    return model


def attention_context(args):
    if args.attn != "cudnn":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION])


def step(model, opt, ids, args):
    with attention_context(args):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(model, seq, args, vocab):
    ids = torch.randint(0, vocab, (1, seq), device="cuda")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    for _ in range(args.warmup):
        step(model, opt, ids, args)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(model, opt, ids, args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    return {"seq": seq, "tokens_per_s": seq / (ms / 1000.0), "step_ms": ms,
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "status": "ok"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a config.json (configs/*.json)")
    p.add_argument("--seq", default="4k", help="comma-separated lengths, e.g. 4k,16k,32k")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--targets", default=DENSE_TARGETS, help="PEFT target module names, comma-separated")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "cudnn", "eager", "flash_attention_2"])
    p.add_argument("--liger", action="store_true", help="apply liger-kernel's fused kernels")
    p.add_argument("--quantize", choices=["nf4", "fp4"], help="bitsandbytes 4-bit base weights")
    p.add_argument("--double-quant", action="store_true")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()

    cfg = text_config(args.config)
    model = build_model(args, cfg)
    settings = {"config": os.path.basename(args.config), "lora_rank": args.lora_rank, "targets": args.targets,
                "attn": args.attn, "liger": args.liger, "quantize": args.quantize or "none",
                "double_quant": args.double_quant, "transformers": transformers.__version__,
                "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    for seq in [parse_length(s) for s in args.seq.split(",")]:
        try:
            row = measure(model, seq, args, cfg.vocab_size)
        except torch.OutOfMemoryError:
            row = {"seq": seq, "status": "oom", "peak_allocated_bytes": torch.cuda.max_memory_allocated()}
            print(json.dumps({**row, **settings}), flush=True)
            break
        print(json.dumps({**row, **settings}), flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
