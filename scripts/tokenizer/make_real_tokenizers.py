#!/usr/bin/env python3
"""Writes tokenizer folders with real vocabularies for spindle's optional tokenizer tests, from the
files the mistral-common wheel ships (mistral_common/data/), converted the way transformers 5.17
converts them:

  mistral_v1         Mistral-7B v0.1 (tokenizer.model.v1, 32000 SentencePiece BPE pieces with byte
                     fallback) in the legacy layout its published tokenizer.json has:
                     Prepend("▁") + Replace(" ", "▁") normalizers, <s> template, Strip decoder.
  mistral_v1_first   the same vocabulary as transformers' LlamaTokenizer builds it (legacy=False):
                     Metaspace(prepend_scheme "first", split false).
  mistral_v3         Mistral-7B v0.3 (mistral_instruct_tokenizer_240323.model.v3: 32768 pieces with
                     the [INST] control tokens), Metaspace "first".
  tekken             Mistral-Nemo's tekken_240911.json through transformers' MistralConverter
                     (131072 tokens, byte-level, ignore_merges).

They are too large for the repository (1-20 MB each). Put them where SPINDLE_TEST_TOKENIZERS points
(beside qwen3/, qwen2_5/, llama3/) and tests/tokenizer/test_tokenizer_sentencepiece.cpp compares
spindle with HF `tokenizers` on them.

usage: make_real_tokenizers.py OUT_DIR
needs: tokenizers, transformers==5.17.0, sentencepiece, protobuf, mistral-common (pip)
"""
import json
import os
import shutil
import sys
import tempfile

import mistral_common
from tokenizers import Tokenizer, normalizers, processors
from transformers import AutoTokenizer
from transformers.integrations.mistral.tokenizer import MistralConverter

DATA = os.path.join(os.path.dirname(mistral_common.__file__), "data")
LLAMA_CONFIG = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                "add_bos_token": True, "add_eos_token": False}


def from_sentencepiece(model_file, config, workdir):
    folder = tempfile.mkdtemp(dir=workdir)
    shutil.copy(os.path.join(DATA, model_file), os.path.join(folder, "tokenizer.model"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return AutoTokenizer.from_pretrained(folder).backend_tokenizer


def with_bos(tokenizer):
    bos_id = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)])
    return tokenizer


def write(out, name, tokenizer, config):
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    print(f"{folder}: {os.path.getsize(os.path.join(folder, 'tokenizer.json'))} bytes")


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    with tempfile.TemporaryDirectory() as workdir:
        first = with_bos(from_sentencepiece("tokenizer.model.v1", dict(LLAMA_CONFIG, legacy=False), workdir))
        legacy = Tokenizer.from_str(first.to_str())
        legacy.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        legacy.pre_tokenizer = None
        data = json.loads(legacy.to_str())
        data["model"]["unk_token"] = "<unk>"
        write(out, "mistral_v1", Tokenizer.from_str(json.dumps(data)), dict(LLAMA_CONFIG, legacy=True))
        write(out, "mistral_v1_first", first, dict(LLAMA_CONFIG, legacy=False))
        v3 = with_bos(from_sentencepiece("mistral_instruct_tokenizer_240323.model.v3", dict(LLAMA_CONFIG, legacy=False),
                                         workdir))
        write(out, "mistral_v3", v3, dict(LLAMA_CONFIG, legacy=False))
        tekken = MistralConverter(os.path.join(DATA, "tekken_240911.json")).converted()
        write(out, "tekken", tekken, {"tokenizer_class": "TokenizersBackend", "bos_token": "<s>", "eos_token": "</s>",
                                      "unk_token": "<unk>"})


if __name__ == "__main__":
    main()
