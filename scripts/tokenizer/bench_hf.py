#!/usr/bin/env python3
"""Single-thread HF `tokenizers` throughput: encode each document of a JSONL ({"text": ...}) once.
  TOKENIZERS_PARALLELISM=false bench_hf.py TOKENIZER_DIR TEXTS.jsonl"""
import json
import os
import sys
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"
import tokenizers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

tok = Tokenizer.from_file(os.path.join(sys.argv[1], "tokenizer.json"))
with open(sys.argv[2], encoding="utf-8") as f:
    docs = [json.loads(line)["text"] for line in f]
size = sum(len(d.encode("utf-8")) for d in docs)
start = time.perf_counter()
tokens = 0
for doc in docs:
    tokens += len(tok.encode(doc).ids)
seconds = time.perf_counter() - start
print(f"hf tokenizers {tokenizers.__version__}: {len(docs)} docs, {size / 1e6:.1f} MB, {tokens} tokens, "
      f"{seconds:.2f} s, {tokens / seconds / 1e6:.2f} M tokens/s, {size / seconds / 1e6:.1f} MB/s")
