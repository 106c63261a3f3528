#!/usr/bin/env python3
"""`spindle generate` is greedy decoding consistent with `spindle eval`:

- on the HF reference models (with and without a LoRA adapter), each generated token is the one
  `spindle eval` gives the lowest cross-entropy among every token of the vocabulary;
- decoding is deterministic, resumable (prompt + first tokens continues with the rest) and
  independent of the other prompts decoded with it (--input);
- with a tokenizer and chat template (the demo's), --chat and --messages tokenize exactly what
  jinja2 + HF tokenizers give for apply_chat_template(add_generation_prompt=True), and the output
  text is the decoding of the ids. Skipped when numpy/safetensors/tokenizers/jinja2 are missing.
"""
import json
import os
import subprocess
import sys
import tempfile

spindle, root = sys.argv[1], sys.argv[2]
failures = []


def check(ok, message):
    print(("ok: " if ok else "FAIL: ") + message)
    if not ok:
        failures.append(message)


def run(args):
    out = subprocess.run([spindle] + args, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"spindle {' '.join(args)}: exit {out.returncode}: {out.stderr}")
    return out.stdout


def generate(model, extra):
    return [json.loads(line) for line in run(["generate", "--model", model, "--json"] + extra).splitlines()]


def eval_loss(model, adapter, tmp, prompt, target):
    path = os.path.join(tmp, "one.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps({"input_ids": prompt + [target], "labels": [-100] * len(prompt) + [target]}) + "\n")
    cmd = ["eval", "--model", model, "--data", path] + (["--adapter", adapter] if adapter else [])
    return json.loads(run(cmd))["loss"]


def check_reference_model(case, tmp):
    model = os.path.join(root, "testdata", "hf", case)
    adapter = os.path.join(model, "adapter") if os.path.isdir(os.path.join(model, "adapter")) else None
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    first = json.loads(open(os.path.join(model, "data.jsonl")).readline())
    prompt = first["input_ids"][:6]
    extra = ["--adapter", adapter] if adapter else []
    ids_arg = ["--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "5"]

    a = generate(model, ids_arg + extra)[0]
    b = generate(model, ids_arg + extra)[0]
    check(a["ids"] == b["ids"], f"{case}: two runs generate the same ids {a['ids']}")
    check(len(a["ids"]) == 5 and a["stop"] == "max_new_tokens" and all(0 <= t < vocab for t in a["ids"]),
          f"{case}: 5 tokens from the vocabulary, stopped by --max-new-tokens")
    check(a["prompt_ids"] == prompt, f"{case}: prompt ids echoed")

    # Greedy = argmax: at the first two positions, eval's CE of the generated token is the lowest.
    for k in range(2):
        context = prompt + a["ids"][:k]
        losses = [eval_loss(model, adapter, tmp, context, t) for t in range(vocab)]
        best = min(range(vocab), key=lambda t: losses[t])
        check(losses[a["ids"][k]] <= losses[best] + 1e-6,
              f"{case}: token {k} = {a['ids'][k]} has the lowest eval CE ({losses[a['ids'][k]]:.6f}; "
              f"best {best} at {losses[best]:.6f})")

    resumed = generate(model, ["--prompt-ids", ",".join(map(str, prompt + a["ids"][:2])), "--max-new-tokens", "3"] + extra)[0]
    check(resumed["ids"] == a["ids"][2:], f"{case}: continuing prompt + 2 generated tokens gives the other 3")

    other = first["input_ids"][3:12]
    batch = os.path.join(tmp, "batch.jsonl")
    with open(batch, "w") as f:
        f.write(json.dumps({"input_ids": other}) + "\n" + json.dumps({"input_ids": prompt}) + "\n")
    together = generate(model, ["--input", batch, "--max-new-tokens", "5"] + extra)
    alone = generate(model, ["--prompt-ids", ",".join(map(str, other)), "--max-new-tokens", "5"] + extra)[0]
    check(together[1]["ids"] == a["ids"] and together[0]["ids"] == alone["ids"],
          f"{case}: prompts decoded together (--input) give what each gives alone")


def check_chat(tmp):
    try:
        import jinja2
        import numpy  # noqa: F401  (make_model.py)
        import safetensors  # noqa: F401
        from tokenizers import Tokenizer
    except ImportError as e:
        print(f"skipping the chat checks: {e} (make deps installs it)")
        return
    model = os.path.join(tmp, "chat_model")
    subprocess.run([sys.executable, os.path.join(root, "demo", "make_model.py"), model, "--hidden-size", "32",
                    "--intermediate-size", "64", "--layers", "1"], check=True, capture_output=True)
    config = json.load(open(os.path.join(model, "tokenizer_config.json")))
    tokenizer = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(config["chat_template"]).render(
        messages=messages, add_generation_prompt=True, eos_token=config["eos_token"])
    want = tokenizer.encode(text, add_special_tokens=False).ids

    by_messages = generate(model, ["--messages", json.dumps(messages), "--max-new-tokens", "4"])[0]
    by_chat = generate(model, ["--chat", "--prompt", messages[0]["content"], "--max-new-tokens", "4"])[0]
    check(by_messages["prompt_ids"] == want, "--messages tokenizes as apply_chat_template(add_generation_prompt=True)")
    check(by_chat == by_messages, "--chat --prompt equals --messages with one user message")
    check(by_messages["text"] == tokenizer.decode(by_messages["ids"], skip_special_tokens=False),
          "the printed text is the decoding of the generated ids")
    plain = run(["generate", "--model", model, "--chat", "--prompt", messages[0]["content"], "--max-new-tokens", "4"])
    check(plain == by_chat["text"] + "\n", "without --json the continuation alone is printed")
    eos = tokenizer.token_to_id(config["eos_token"])
    check(eos not in by_chat["ids"], "the end-of-turn token stops generation and is not printed")


with tempfile.TemporaryDirectory() as tmp:
    for case in ["qwen2", "qwen2_lora", "llama"]:
        check_reference_model(case, tmp)
    check_chat(tmp)
print(f"{len(failures)} failure(s)")
sys.exit(1 if failures else 0)
