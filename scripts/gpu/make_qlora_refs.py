#!/usr/bin/env python3
"""Makes the QLoRA parity references (transformers + bitsandbytes + peft) that tests/quant checks
spindle against.

Runs on the GPU host (bitsandbytes' 4-bit layers run on CUDA; bring its wheel, scripts/gpu/README.md).
Everything computes in fp32: weights loaded as fp32, bnb_4bit_compute_dtype float32, TF32 off, LoRA
adapters fp32, eager attention. For each case it writes, under OUT/<case>/:
  config.json, model.safetensors   quantise-at-load cases: the unquantised fp32 model (spindle
                                   quantises it with --quantize); pre-quantised cases: the folder
                                   transformers saves from the 4-bit model (quantization_config in
                                   config.json, packed weights and quant_state tensors)
  adapter/                         a PEFT adapter with random nonzero A and B
  data.jsonl, expected.safetensors, expected.json   as make_hf_refs.py writes them (loss, num_items,
                                   logits, grad.<LoRA parameter>), computed on the 4-bit model
The loss is docs/design.md §2.2, each document run on its own.

Usage: python3 make_qlora_refs.py OUT_DIR
"""
import json
import os

# make_hf_refs turns on deterministic algorithms, which cuBLAS honours only with this set.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import shutil
import sys
import zlib

import torch
import transformers
from safetensors.torch import save_file

import bitsandbytes
import peft

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_refs import VOCAB, documents  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else "out/hf"
DEVICE = os.environ.get("QLORA_REFS_DEVICE", "cuda")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def reference(model, docs, trainable):
    """Loss, num_items, logits and LoRA gradients (docs/design.md §2.2), documents one at a time."""
    model.zero_grad(set_to_none=True)
    num_items = sum(sum(1 for t in d["labels"][1:] if t != -100) for d in docs)
    total = torch.zeros((), dtype=torch.float64)
    all_logits = []
    for d in docs:
        ids = torch.tensor([d["input_ids"]], device=DEVICE)
        logits = model(input_ids=ids).logits[0].float()  # [L, V]
        all_logits.append(logits.detach().cpu())
        labels = torch.tensor(d["labels"][1:], device=DEVICE)
        scale = torch.tensor(d["loss_scale"][1:], dtype=torch.float32, device=DEVICE)
        mask = labels != -100
        if mask.any():
            ce = torch.nn.functional.cross_entropy(logits[:-1][mask], labels[mask], reduction="none")
            part = (ce * scale[mask]).sum() / num_items
            part.backward()
            total += part.detach().double().cpu()
    out = {"loss": total.reshape(1), "num_items": torch.tensor([num_items], dtype=torch.int64),
           "logits": torch.cat(all_logits).contiguous()}
    for name, p in trainable:
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out["grad." + name] = g.detach().float().cpu().contiguous()
    return out, float(total)


def bnb_config(quant_type, double_quant, storage):
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                           bnb_4bit_use_double_quant=double_quant,
                                           bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=storage)


def write_case(name, config, quant_type, double_quant, storage, prequantized, lora):
    seed = zlib.crc32(name.encode())
    rng = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():  # norms and biases away from their init, as make_hf_refs.py does
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "bias" in n:
                p.copy_(0.1 * torch.randn_like(p))
    folder = os.path.join(OUT, name)
    plain = os.path.join(OUT, name + ".fp32") if prequantized else folder
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(plain, safe_serialization=True)
    del model

    # Quantise at load, as transformers does for load_in_4bit: every nn.Linear but the LM head.
    model = transformers.AutoModelForCausalLM.from_pretrained(
        plain, quantization_config=bnb_config(quant_type, double_quant, storage), dtype=torch.float32,
        device_map={"": DEVICE}, attn_implementation="eager")
    if prequantized:
        model.save_pretrained(folder, safe_serialization=True)
        shutil.rmtree(plain)
        # Run what a user of the saved folder would run: the model as loaded back from it.
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, device_map={"": DEVICE},
                                                                  attn_implementation="eager")
    model = peft.get_peft_model(model, peft.LoraConfig(**lora))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "lora_A" in n:
                p.copy_(0.3 * torch.randn(p.shape, generator=rng).to(p.device))
    model.save_pretrained(os.path.join(folder, "adapter"))
    trainable = [(n.replace(".default", ""), p) for n, p in model.named_parameters() if p.requires_grad]
    for n, p in trainable:
        assert p.dtype == torch.float32, (n, p.dtype)
    model.eval()

    docs = documents(rng)
    with open(os.path.join(folder, "data.jsonl"), "w") as f:
        for d in docs:
            f.write(json.dumps(d) + "\n")
    tensors, loss = reference(model, docs, trainable)
    save_file(tensors, os.path.join(folder, "expected.safetensors"))
    json.dump({"loss": loss, "num_items": int(tensors["num_items"][0]), "transformers": transformers.__version__,
               "torch": torch.__version__, "peft": peft.__version__, "bitsandbytes": bitsandbytes.__version__,
               "quant_type": quant_type, "double_quant": double_quant, "quant_storage": str(storage),
               "prequantized": prequantized, "trainable": [n for n, _ in trainable]},
              open(os.path.join(folder, "expected.json"), "w"), indent=1)
    print(f"{name}: loss {loss:.8f} num_items {int(tensors['num_items'][0])} tensors {len(tensors)}")


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
    qwen2 = transformers.Qwen2Config(**common, tie_word_embeddings=True,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    llama = transformers.LlamaConfig(**common, tie_word_embeddings=False,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS)
    # Quantise at load (spindle: --quantize nf4 [--double-quant]).
    write_case("qwen2_nf4", qwen2, "nf4", False, torch.uint8, False, lora)
    write_case("qwen2_nf4_dq", qwen2, "nf4", True, torch.uint8, False, lora)
    # Pre-quantised folders (spindle: no flag), each storage and both 4-bit types.
    write_case("qwen2_nf4_dq_saved", qwen2, "nf4", True, torch.uint8, True, lora)
    write_case("llama_nf4_bf16_saved", llama, "nf4", True, torch.bfloat16, True,
               dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]))
    write_case("llama_fp4_f32_saved", llama, "fp4", False, torch.float32, True, lora)


if __name__ == "__main__":
    main()
