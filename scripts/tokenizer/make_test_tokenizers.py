#!/usr/bin/env python3
"""Writes the small tokenizer folders under testdata/tokenizers/ and the ids HF `tokenizers` gives
for them, so that spindle's tokenizer tests run on SentencePiece-style and Tekken/o200k-style files
without any data beside the checkout.

Each folder is built the way the published files are built, with a small vocabulary:

  llama2_legacy      SentencePiece BPE (byte_fallback, split digits, whitespace pieces) converted by
                     transformers, with the legacy Prepend("▁") + Replace(" ", "▁") normalizers and
                     the Strip decoder: the layout of the Llama-2, Mistral-7B v0.1 and Phi-3 files.
  phi3_style         llama2_legacy plus Phi-3's chat tokens (rstrip=True, as Phi-3 ships them).
  llama_first        what transformers 5.17 writes for a LlamaTokenizer with legacy=False:
                     Metaspace(prepend_scheme "first", split false); Mistral v0.3 layout, with the
                     [INST] control tokens.
  llama_always       the same with legacy=True: Metaspace(prepend_scheme "always").
  metaspace_split    Metaspace(always, split true) and the Metaspace decoder.
  metaspace_never    Metaspace(never, split true), the Metaspace decoder, ignore_merges.
  unk_fused          no byte fallback: unknown characters become one fused <unk>.
  unk_unfused        no byte fallback, fuse_unk false: one <unk> per unknown character.
  unk_dropped        no byte fallback and no unk_token: unknown characters are dropped.
  gemma              SentencePiece BPE converted by transformers' GemmaTokenizer: Replace(" ", "▁")
                     normalizer, Split(" ") pre-tokenizer, <bos> template, <start_of_turn> tokens.
  tekken_small       the first 2000 ranks of Mistral's tekken_240911.json (mistral-common wheel)
                     converted by transformers' MistralConverter: Split(tekken pattern) + ByteLevel,
                     ignore_merges, 1000 special tokens (Mistral-Nemo, Mistral-Small 3).
  o200k_small        byte-level BPE trained here with gpt-oss's o200k split pattern, its ByteLevel
                     steps and its harmony special tokens (<|start|>, <|channel|>, ...).

For every folder, expected.jsonl holds HF's ids (with and without special tokens), byte offsets
and decodings for each text of testdata/tokenizers/texts.jsonl (written here too), in the format of
tests/tokenizer/hf_oracle.py.

usage: make_test_tokenizers.py [--out testdata/tokenizers]
needs: tokenizers, transformers==5.17.0, sentencepiece, protobuf, mistral-common (pip)
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import sentencepiece as spm
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tests", "tokenizer"))
import hf_oracle  # noqa: E402

# gpt-oss's split pattern (o200k_harmony).
O200K_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
HARMONY_TOKENS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                  "<|end|>", "<|message|>", "<|call|>"]
PHI3_TOKENS = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|system|>", "<|end|>", "<|user|>"]

# Texts where SentencePiece-style pipelines differ from each other and from byte-level ones: the
# word marker at starts, after special tokens and in whitespace runs; the marker and byte-token
# spellings written literally; characters outside the vocabulary (byte fallback or unk).
EDGE_TEXTS = [
    "", " ", "  ", "   ", "\t", "\n", " \n ", "Hello", " Hello", "  Hello", "Hello ", "Hello  world", "Hello   world  ",
    "a\nb", "a\n\nb", "a \n b", "\tindented\ttabs", "line1\r\nline2\r\n", "  leading and trailing  ",
    "龘", "𠀀 rare 𪚥 han", "a龘b", " 龘", "😀", " 😀 ", "👩‍💻 coder", "🇺🇸", "\u0000nul", "del\u007f", "\ue000 private",
    "\u2581", "\u2581\u2581", "\u2581Hello", "a\u2581b", " \u2581 ", "<0x41>", "<0xE9><0x9F>", "<0x0A>", "<0xzz>",
    "<unk>", "<s>", "</s>", "<s>Hello", "Hi</s>there", "<s> Hello", " <s>", "<s><s>", "text <s> text",
    "<bos>Hello", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "[INST] Hi [/INST] Hello</s>",
    "[INST]What?[/INST]", "<|user|>\nHello<|end|>\n<|assistant|>\nHi<|end|>", "<|user|> x <|assistant|>  y",
    "<|start|>assistant<|channel|>final<|message|>Hi<|return|>", "<|startoftext|><|endoftext|>",
    "Ünïcödé ÅÉÎÕÜ ñ ß ø", "Straße Größe", "日本語のテキスト", "한국어", "Привет мир", "مرحبا", "नमस्ते",
    "e\u0301 combining", "ﬁ ligature", "12345 67 8", "3.14159", "v1.2.3-rc4", "x=1;y=22;z=333",
    "def f(x):\n    return x  # comment\n", "    four\n        eight\n", "trailing spaces    ",
    "a" * 200, " ".join(["word"] * 50), "\u3000ideographic\u3000space", "nbsp\u00a0here", "zero\u200bwidth",
    "I'm we'll they've DON'T", "mixed 😀 text 龘 and <0x41> and \u2581 marker",
]


def read_jsonl_texts(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def test_texts():
    corpus = read_jsonl_texts(os.path.join(ROOT, "tests", "tokenizer", "corpus.jsonl"))
    # The hand-written part of the corpus (scripts, code, whitespace, digits, emoji, specials,
    # Unicode normalization), without its four long concatenations; the tests run the whole corpus
    # and random strings through the live oracle as well.
    return EDGE_TEXTS + corpus[:144] + corpus[148:156]


def training_text(path):
    corpus = read_jsonl_texts(os.path.join(ROOT, "tests", "tokenizer", "corpus.jsonl"))
    lines = []
    for text in corpus:
        lines.extend(line for line in text.split("\n") if line.strip())
    filler = ("the quick brown fox jumps over the lazy dog and then it runs into the forest where other "
              "animals live together in peace while the hunter waits for the morning light to come")
    lines += [filler] * 20
    lines += ["    return value", "        if x:", "            y = 1", "\tindent", "  two", "   three"] * 10
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def train_sentencepiece(prefix, text_path, gemma):
    options = dict(
        input=text_path, model_prefix=prefix, model_type="bpe", vocab_size=1200, hard_vocab_limit=False,
        byte_fallback=True, character_coverage=0.995, split_digits=True, allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False, normalization_rule_name="identity", num_threads=1,
        shuffle_input_sentence=False, max_sentencepiece_length=16, minloglevel=2)
    if gemma:
        options.update(pad_id=0, eos_id=1, bos_id=2, unk_id=3, add_dummy_prefix=False, control_symbols=["<mask>"],
                       user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], pad_piece="<pad>",
                       eos_piece="<eos>", bos_piece="<bos>", unk_piece="<unk>")
    else:
        options.update(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True)
    spm.SentencePieceTrainer.train(**options)
    return prefix + ".model"


def convert_with_transformers(model_path, config, workdir):
    """The tokenizer transformers 5.17 builds from a SentencePiece model and a tokenizer_config."""
    folder = tempfile.mkdtemp(dir=workdir)
    shutil.copy(model_path, os.path.join(folder, "tokenizer.model"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return AutoTokenizer.from_pretrained(folder).backend_tokenizer


def with_changes(tokenizer, model_changes=None, **parts):
    """A copy of `tokenizer` with pipeline parts (tokenizers objects or None) and model fields replaced."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    for name, value in parts.items():
        setattr(copy, name, value)
    if model_changes:
        data = json.loads(copy.to_str())
        data["model"].update(model_changes)
        copy = Tokenizer.from_str(json.dumps(data))
    return copy


def bos_template(bos, bos_id):
    return processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])


def sentencepiece_family(workdir, text_path):
    llama_model = train_sentencepiece(os.path.join(workdir, "llama"), text_path, gemma=False)
    llama_config = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
                    "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}
    first = convert_with_transformers(llama_model, dict(llama_config, legacy=False), workdir)
    always = convert_with_transformers(llama_model, dict(llama_config, legacy=True), workdir)
    meta = json.loads(first.to_str())["pre_tokenizer"]
    assert meta == {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}, meta
    bos_id = first.token_to_id("<s>")
    template = bos_template("<s>", bos_id)

    folders = {}
    legacy = with_changes(first, {"unk_token": "<unk>"},
                          normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
                          pre_tokenizer=None, post_processor=template)
    folders["llama2_legacy"] = (legacy, dict(llama_config, legacy=True))

    phi3 = with_changes(legacy)
    phi3.add_special_tokens([AddedToken(t, rstrip=(t != "<|endoftext|>"), normalized=False, special=True)
                             for t in PHI3_TOKENS])
    folders["phi3_style"] = (phi3, dict(llama_config, eos_token="<|endoftext|>", pad_token="<|endoftext|>"))

    mistral = with_changes(first, post_processor=template)
    mistral.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ["[INST]", "[/INST]"]])
    folders["llama_first"] = (mistral, dict(llama_config, legacy=False))
    folders["llama_always"] = (with_changes(always, post_processor=template), dict(llama_config, legacy=True))

    folders["metaspace_split"] = (
        with_changes(first, pre_tokenizer=pre_tokenizers.Metaspace("▁", "always", split=True),
                     decoder=decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace("▁", "always")]),
                     post_processor=template),
        llama_config)
    folders["metaspace_never"] = (
        with_changes(first, {"ignore_merges": True},
                     pre_tokenizer=pre_tokenizers.Metaspace("▁", "never", split=True),
                     decoder=decoders.Metaspace("▁", "never"), post_processor=None),
        llama_config)
    unk_base = dict(normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
                    pre_tokenizer=None, post_processor=template)
    folders["unk_fused"] = (with_changes(first, {"byte_fallback": False, "unk_token": "<unk>"}, **unk_base),
                            llama_config)
    folders["unk_unfused"] = (
        with_changes(first, {"byte_fallback": False, "unk_token": "<unk>", "fuse_unk": False}, **unk_base),
        llama_config)
    folders["unk_dropped"] = (with_changes(first, {"byte_fallback": False, "unk_token": None}, **unk_base),
                              llama_config)

    gemma_model = train_sentencepiece(os.path.join(workdir, "gemma"), text_path, gemma=True)
    gemma_config = {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
                    "unk_token": "<unk>", "pad_token": "<pad>", "mask_token": "<mask>", "add_bos_token": True,
                    "add_eos_token": False}
    gemma = convert_with_transformers(gemma_model, gemma_config, workdir)
    gemma_json = json.loads(gemma.to_str())
    assert gemma_json["normalizer"]["type"] == "Replace", gemma_json["normalizer"]
    if gemma_json["post_processor"] is None or "<bos>" not in json.dumps(gemma_json["post_processor"]):
        gemma = with_changes(gemma, post_processor=bos_template("<bos>", gemma.token_to_id("<bos>")))
    folders["gemma"] = (gemma, gemma_config)
    return folders


def tekken_small(workdir):
    import mistral_common
    from transformers.integrations.mistral.tokenizer import MistralConverter
    source = os.path.join(os.path.dirname(mistral_common.__file__), "data", "tekken_240911.json")
    with open(source, encoding="utf-8") as f:
        tekken = json.load(f)
    ranks = 2000
    tekken["vocab"] = tekken["vocab"][:ranks]
    tekken["config"]["num_vocab_tokens"] = ranks
    tekken["config"]["default_vocab_size"] = ranks + tekken["config"]["default_num_special_tokens"]
    tekken.pop("image", None)
    path = os.path.join(workdir, "tekken.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tekken, f)
    tokenizer = MistralConverter(path).converted()
    config = {"tokenizer_class": "TokenizersBackend", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    return tokenizer, config


def o200k_small(text_path):
    tokenizer = Tokenizer(models.BPE(ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=1500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train([text_path], trainer)
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in HARMONY_TOKENS])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
              "pad_token": "<|endoftext|>"}
    return tokenizer, config


def write_folder(out, name, tokenizer, config, texts_path):
    folder = os.path.join(out, name)
    os.makedirs(folder, exist_ok=True)
    data = json.loads(tokenizer.to_str())
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))  # HF must load what is committed
    expected_path = os.path.join(folder, "expected.jsonl")
    with open(texts_path, encoding="utf-8") as stdin, open(expected_path, "w", encoding="utf-8") as stdout:
        hf_oracle.encode_stream(folder, stdin, stdout)
    sizes = {f: os.path.getsize(os.path.join(folder, f)) for f in sorted(os.listdir(folder))}
    print(f"{name}: {sizes}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(ROOT, "testdata", "tokenizers"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    texts_path = os.path.join(args.out, "texts.jsonl")
    with open(texts_path, "w", encoding="utf-8") as f:
        for text in test_texts():
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    with tempfile.TemporaryDirectory() as workdir:
        text_path = os.path.join(workdir, "train.txt")
        training_text(text_path)
        folders = sentencepiece_family(workdir, text_path)
        folders["tekken_small"] = tekken_small(workdir)
        folders["o200k_small"] = o200k_small(text_path)
        for name, (tokenizer, config) in folders.items():
            write_folder(args.out, name, tokenizer, config, texts_path)


if __name__ == "__main__":
    main()
