#!/usr/bin/env python3
"""Trains the demo's byte-level BPE tokenizer on the demo dataset and writes it as a Qwen2-style
Hugging Face tokenizer (tokenizer.json, tokenizer_config.json with a ChatML chat template). Run once;
the output is committed, so `make demo` needs no download."""
import json
import os

import make_dataset
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "tokenizer")
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer split, so spindle's tokenizer runs the same code path as on a real Qwen model.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# ChatML as Qwen uses it, without Qwen's default system prompt (it would triple the sequence length).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def corpus():
    # Every conversation twice, so every word of the dataset passes min_frequency and becomes one
    # token, as common names are in real vocabularies: the demo model then learns one lookup per
    # country instead of spelling capitals out, which a minute of CPU training can do.
    for _ in range(2):
        for country, capital in make_dataset.pairs():
            yield f"user\n{make_dataset.question(country)}\nassistant\n{capital}\n"


def main():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    os.makedirs(OUT, exist_ok=True)
    tokenizer.save(os.path.join(OUT, "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(tokenizer.token_to_id(t)): {"content": t, "lstrip": False, "rstrip": False, "normalized": False,
                                            "single_word": False, "special": True} for t in SPECIAL_TOKENS},
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(OUT, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    print(f"wrote {OUT}: {tokenizer.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
