"""Reference chat encodings for spindle's tests: what transformers' apply_chat_template(...,
tokenize=True) gives, rebuilt from its parts because transformers itself is not installed in CI:
Python jinja2 in transformers' environment (hfenv.py from the template corpus) renders, HF
`tokenizers` encodes the rendering with add_special_tokens=False, and for templates with
{% generation %} blocks the assistant mask is computed exactly as transformers'
return_assistant_tokens_mask does (char_to_token of each block's first and last character).

usage: chat_reference.py HFENV_DIR REQUEST.json OUT.json
REQUEST.json: {"now": [y, m, d, H, M], "cases": [{"tokenizer_dir": str, "template": str | null,
               "sample": {...}, "add_generation_prompt": bool}]}
  template null: the tokenizer_config.json chat_template. The sample gives "messages" and
  optionally "tools" and "chat_template_kwargs", passed as TRL passes them.
OUT.json: [{"text": str, "ids": [...], "mask": [...] | null} | {"error": str}] in case order.
"""
import json
import os
import sys
from datetime import datetime

sys.path.insert(0, sys.argv[1])
import hfenv  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

SPECIAL_TOKENS = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"]

request = json.load(open(sys.argv[2], encoding="utf-8"))
fixed_now = datetime(*request["now"])
hfenv.ENV.globals["strftime_now"] = lambda fmt: fixed_now.strftime(fmt)
tokenizers = {}
configs = {}
results = []
for case in request["cases"]:
    directory = case["tokenizer_dir"]
    if directory not in tokenizers:
        tokenizers[directory] = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        configs[directory] = json.load(open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8"))
    tokenizer, config = tokenizers[directory], configs[directory]
    source = case["template"] if case["template"] is not None else config["chat_template"]
    # transformers: the special tokens (strings or AddedToken dicts; unset ones are not passed),
    # then messages, tools, documents, add_generation_prompt and the extra keyword arguments.
    context = {}
    for key in SPECIAL_TOKENS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            context[key] = value
    sample = case["sample"]
    context.update(messages=sample["messages"], tools=sample.get("tools"), documents=None,
                   add_generation_prompt=case["add_generation_prompt"])
    context.update(sample.get("chat_template_kwargs", {}))
    try:
        template = hfenv.ENV.from_string(source)
        blocks, indices = [], []
        with template.environment.activate_tracker(blocks, indices):
            for block in template.generate(**context):
                blocks.append(block)
        text = "".join(blocks)
    except Exception as error:  # the C++ side must fail on the same samples
        results.append({"error": f"{type(error).__name__}: {error}"})
        continue
    encoding = tokenizer.encode(text, add_special_tokens=False)
    mask = None
    if "{% generation %}" in source or "{%- generation %}" in source:
        # transformers.PreTrainedTokenizerBase.apply_chat_template, return_assistant_tokens_mask
        mask = [0] * len(encoding.ids)
        for start_char, end_char in indices:
            start_token = encoding.char_to_token(start_char)
            end_token = encoding.char_to_token(end_char - 1)
            if start_token is None:
                break
            for token in range(start_token, end_token + 1 if end_token else len(encoding.ids)):
                mask[token] = 1
    results.append({"text": text, "ids": encoding.ids, "mask": mask})
json.dump(results, open(sys.argv[3], "w", encoding="utf-8"), ensure_ascii=False)
