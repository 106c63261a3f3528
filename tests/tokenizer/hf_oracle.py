#!/usr/bin/env python3
"""Reference ids from Hugging Face `tokenizers` for spindle's differential tokenizer tests.

  hf_oracle.py encode --tokenizer DIR < texts.jsonl > expected.jsonl
      Each input line {"text": ...} gives one output line with the ids with and without special
      tokens, each token's byte span in the UTF-8 text, and both decodings.
  hf_oracle.py variant --base DIR --name NAME --out DIR
      Writes a tokenizer folder that is the base with one feature changed (added-token flags, a BOS
      template, other Split behaviours, ...), so the features the shipped files leave unused are
      checked against HF too.

Exit code 3 when the `tokenizers` package is missing, so the test can skip with a message.
"""
import argparse
import json
import os
import shutil
import sys

try:
    from tokenizers import AddedToken, Tokenizer
except ImportError:
    print("python package 'tokenizers' is not installed (pip install tokenizers)", file=sys.stderr)
    sys.exit(3)


def byte_offsets(text, char_offsets):
    starts = [0]
    for ch in text:
        starts.append(starts[-1] + len(ch.encode("utf-8")))
    return [[starts[b], starts[e]] for b, e in char_offsets]


def encode_stream(tokenizer_dir, lines, out):
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    for line in lines:
        text = json.loads(line)["text"]
        enc = tok.encode(text)
        plain = tok.encode(text, add_special_tokens=False)
        out.write(json.dumps({
            "ids": enc.ids,
            "ids_plain": plain.ids,
            "offsets": byte_offsets(text, enc.offsets),
            "decoded": tok.decode(enc.ids, skip_special_tokens=False),
            "decoded_skip": tok.decode(enc.ids, skip_special_tokens=True),
        }, ensure_ascii=False) + "\n")


def encode(args):
    encode_stream(args.tokenizer, sys.stdin, sys.stdout)


def variant(args):
    with open(os.path.join(args.base, "tokenizer.json"), encoding="utf-8") as f:
        data = json.load(f)
    name = args.name
    if name == "added_flags":
        tok = Tokenizer.from_str(json.dumps(data))
        tok.add_tokens([
            AddedToken("<mask>", lstrip=True, rstrip=False, normalized=False),
            AddedToken("[SEP]", lstrip=False, rstrip=True, normalized=False),
            AddedToken("<both>", lstrip=True, rstrip=True, normalized=False),
            AddedToken("qqword", single_word=True, normalized=False),
            AddedToken("café", normalized=True),
            AddedToken("qqwordy", normalized=False),
        ])
        tok.add_special_tokens([AddedToken("<|sp_norm|>", normalized=True)])
        data = json.loads(tok.to_str())
    elif name == "bos_template":
        # The post-processor the Llama 3.1 release ships: ByteLevel then a BOS template.
        bos = "<|begin_of_text|>"
        bos_id = next(t["id"] for t in data["added_tokens"] if t["content"] == bos)
        eos = "<|end_of_text|>"
        eos_id = next(t["id"] for t in data["added_tokens"] if t["content"] == eos)
        data["post_processor"] = {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                        {"SpecialToken": {"id": eos, "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]},
                                eos: {"id": eos, "ids": [eos_id], "tokens": [eos]}}}]}
    elif name.startswith("split_"):
        # split_<behavior>[_invert]: a literal/regex Split with another behaviour, then GPT-2 ByteLevel.
        parts = name.split("_")
        behavior = parts[1]
        invert = len(parts) > 2 and parts[2] == "invert"
        pattern = {"Regex": r"\s+|\p{P}"} if behavior != "Contiguous" else {"String": " "}
        data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": pattern, "behavior": behavior, "invert": invert},
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
    elif name == "nfkc_trim":
        data["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "NFKC"}]}
        data["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                  "use_regex": False}
    else:
        sys.exit(f"unknown variant {name}")
    Tokenizer.from_str(json.dumps(data))  # HF must accept what the test will load
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)
    config = os.path.join(args.base, "tokenizer_config.json")
    if os.path.exists(config):
        shutil.copy(config, os.path.join(args.out, "tokenizer_config.json"))


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("encode")
    p.add_argument("--tokenizer", required=True)
    p = sub.add_parser("variant")
    p.add_argument("--base", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--out", required=True)
    args = parser.parse_args()
    {"encode": encode, "variant": variant}[args.command](args)


if __name__ == "__main__":
    main()
