#!/usr/bin/env python3
"""Checks that the Python stack loads what spindle exports and computes what spindle computed.

Input: a folder written by the PythonStackCases test of tests/train/test_export.cpp
(SPINDLE_EXPORT_CASES_DIR=<dir>): one sub-folder per case and cases.json, which names for each case
its kind (a PEFT "adapter" or a full HF "model"), its base (a testdata/hf model, relative to the
repository root), a fixed document and spindle's per-token cross-entropy on it.

For each case:
  model    from_pretrained(folder) of the class config.json names: no missing, unexpected or mismatched keys, a tied
           head tied again, the parameters in the dtype config.json names when loaded with dtype="auto"
  adapter  PeftModel.from_pretrained(base, folder) with no warning about missing or unexpected keys, every
           LoRA tensor of the file in the model, and AutoPeftModelForCausalLM (AutoPeftModel for the
           adapter of a multimodal base, through its auto_mapping) finding the base through
           base_model_name_or_path
then the per-token cross-entropy from the loaded model's logits (fp32, CPU, so no TF32 or kernel choice
blurs it) against spindle's: max |difference| must stay below --tolerance.

Prints one line per case and a final PASS or FAIL line; exit status 0 only on PASS.
Usage (repository root): python3 scripts/gpu/check_exports.py [CASES_DIR] [--tolerance 1e-4]
"""
import argparse
import json
import logging
import os
import sys
import warnings

import torch
import transformers
from safetensors.torch import load_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY_WORDS = ("missing", "unexpected", "mismatch", "not initialized", "newly initialized")


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


NOTES = []  # every other warning, shown once at the end: harmless ones should still be seen


def load_quietly(load):
    """Runs load() and returns (result, warnings and log records that mention missing/unexpected keys)."""
    handler = Captured()
    loggers = [logging.getLogger(name) for name in ("transformers", "peft")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = load()
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    messages = handler.messages + [str(w.message) for w in caught]
    flagged = [m for m in messages if any(k in m.lower() for k in KEY_WORDS)]
    NOTES.extend(m for m in messages if m not in flagged and m not in NOTES)
    return result, flagged


def token_ce(model, input_ids):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([input_ids])).logits[0].double()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return (-logp.gather(1, torch.tensor(input_ids[1:])[:, None])[:, 0]).tolist()


def model_class(folder):
    """The class config.json names (a multimodal checkpoint, e.g. Qwen3_5MoeForConditionalGeneration, keeps
    its text model under model.language_model; AutoModelForCausalLM may pick the text-only class)."""
    with open(os.path.join(folder, "config.json")) as f:
        architectures = json.load(f).get("architectures") or []
    named = getattr(transformers, architectures[0], None) if architectures else None
    return named or transformers.AutoModelForCausalLM


def check_model(case, folder):
    problems = []
    (model, info), complaints = load_quietly(lambda: model_class(folder).from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", output_loading_info=True))
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(key):
            problems.append(f"{key}: {sorted(info[key])[:5]}")
    problems += [f"warning: {m}" for m in complaints]
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    if config.get("dtype") != case["saved_dtype"]:
        problems.append(f"config.json dtype {config.get('dtype')!r}, expected {case['saved_dtype']!r}")
    if config.get("tie_word_embeddings"):
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            problems.append("tie_word_embeddings is set but lm_head is not the embedding after loading")
    auto = model_class(folder).from_pretrained(folder, dtype="auto")
    dtypes = {str(p.dtype).replace("torch.", "") for p in auto.parameters()}
    if dtypes != {case["saved_dtype"]}:
        problems.append(f'dtype="auto" loads parameters as {sorted(dtypes)}, expected {case["saved_dtype"]}')
    return model, problems


def check_adapter(case, folder):
    from peft import AutoPeftModel, AutoPeftModelForCausalLM, PeftModel

    problems = []
    base_dir = os.path.join(REPO, case["base"])
    base = model_class(base_dir).from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    model, complaints = load_quietly(lambda: PeftModel.from_pretrained(base, folder))
    problems += [f"warning: {m}" for m in complaints]
    saved = load_file(os.path.join(folder, "adapter_model.safetensors"))
    state = {name: p for name, p in model.named_parameters()}
    for name, tensor in saved.items():
        # PEFT inserts the adapter name: ...q_proj.lora_A.weight -> ...q_proj.lora_A.default.weight
        loaded = name.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight")
        if loaded not in state:
            problems.append(f"{name} of the file is not a parameter of the PEFT model")
        elif not torch.equal(state[loaded].detach().to(tensor.dtype), tensor):
            problems.append(f"{name} differs after loading")
    lora_in_model = [n for n in state if ".lora_" in n]
    if len(lora_in_model) != len(saved):
        problems.append(f"the PEFT model has {len(lora_in_model)} LoRA tensors, the file {len(saved)}")
    if all(torch.count_nonzero(t) == 0 for n, t in saved.items() if "lora_B" in n):
        problems.append("every lora_B is zero: the case would not test the adapter")
    cwd = os.getcwd()
    try:
        os.chdir(REPO)  # base_model_name_or_path is relative to the repository root
        # An adapter of a multimodal base names its class in auto_mapping (as PEFT writes it), for AutoPeftModel.
        with open(os.path.join(folder, "adapter_config.json")) as f:
            auto_class = AutoPeftModel if json.load(f).get("auto_mapping") else AutoPeftModelForCausalLM
        auto, complaints = load_quietly(lambda: auto_class.from_pretrained(
            os.path.abspath(os.path.join(cwd, folder)), dtype=torch.float32, attn_implementation="eager"))
        problems += [f"{auto_class.__name__} warning: {m}" for m in complaints]
        auto_ce = token_ce(auto.eval(), case["input_ids"])
    finally:
        os.chdir(cwd)
    return model, problems, auto_ce


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cases", nargs="?", default=".exports")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    import peft

    print(f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}")
    with open(os.path.join(args.cases, "cases.json")) as f:
        manifest = json.load(f)
    failed = []
    for case in manifest:
        folder = os.path.join(args.cases, case["name"])
        extra_ce = None
        try:
            if case["kind"] == "model":
                model, problems = check_model(case, folder)
            else:
                model, problems, extra_ce = check_adapter(case, folder)
            ce = token_ce(model.eval(), case["input_ids"])
        except Exception as e:  # a folder that does not load is this script's finding, not its crash
            problems, ce = [f"loading failed: {type(e).__name__}: {e}"], None
        diff = None
        if ce is not None:
            want = case["token_ce"]
            if len(ce) != len(want):
                problems.append(f"{len(ce)} cross-entropies from transformers, {len(want)} from spindle")
            else:
                diff = max(abs(a - b) for a, b in zip(ce, want))
                if extra_ce is not None:
                    diff = max(diff, max(abs(a - b) for a, b in zip(extra_ce, want)))
                if not diff < args.tolerance:
                    problems.append(f"max |CE difference| {diff:.3g} >= {args.tolerance:g}")
        status = "ok" if not problems else "FAILED"
        shown = f"{diff:.3g}" if diff is not None else "n/a"
        print(f"{case['name']:24s} {case['kind']:8s} {case['saved_dtype']:9s} max|dCE| {shown:10s} {status}")
        for p in problems:
            print(f"    {p}")
        if problems:
            failed.append(case["name"])
    for note in NOTES:
        print(f"note (warning while loading): {note[:300]}")
    if failed:
        print(f"FAIL: {len(failed)} of {len(manifest)} exports: {', '.join(failed)}")
        return 1
    print(f"PASS: {len(manifest)} exports load in transformers/peft and match spindle's per-token CE "
          f"within {args.tolerance:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
