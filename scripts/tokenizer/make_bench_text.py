#!/usr/bin/env python3
"""Writes a ~10 MB JSONL of mixed documents ({"text": ...}) for the tokenizer throughput benchmark:
Python source (code, indentation), Debian copyright/license texts (English prose), and the
multilingual test corpus (CJK, Arabic, Hindi, Thai, emoji, ...). Deterministic for a given machine.

  make_bench_text.py OUT.jsonl [MEGABYTES]
"""
import glob
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def read(path, limit=64 * 1024):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(limit)
    except (UnicodeDecodeError, OSError):
        return None


def main():
    out_path = sys.argv[1]
    target = int(float(sys.argv[2]) * 1e6) if len(sys.argv) > 2 else 10_000_000
    rng = random.Random(7)
    code = sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True))
    prose = sorted(glob.glob("/usr/share/doc/*/copyright") + glob.glob("/usr/share/common-licenses/*"))
    with open(os.path.join(HERE, "..", "..", "tests", "tokenizer", "corpus.jsonl"), encoding="utf-8") as f:
        multilingual = [json.loads(line)["text"] for line in f]
    rng.shuffle(code)
    rng.shuffle(prose)
    budgets = {"code": 0.6 * target, "prose": 0.3 * target, "multilingual": 0.1 * target}
    docs = []
    for kind, files in (("code", code), ("prose", prose)):
        size = 0
        for path in files:
            text = read(path)
            if not text:
                continue
            docs.append(text)
            size += len(text.encode("utf-8"))
            if size >= budgets[kind]:
                break
    size = 0
    while size < budgets["multilingual"]:
        text = "\n".join(rng.sample(multilingual, 20))
        docs.append(text)
        size += len(text.encode("utf-8"))
    rng.shuffle(docs)
    with open(out_path, "w", encoding="utf-8") as f:
        for text in docs:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    total = sum(len(d.encode("utf-8")) for d in docs)
    print(f"{len(docs)} documents, {total / 1e6:.1f} MB of text -> {out_path}")


if __name__ == "__main__":
    main()
