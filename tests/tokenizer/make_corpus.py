#!/usr/bin/env python3
"""Writes corpus.jsonl: the texts of the differential tokenizer test (expected ids come from HF
`tokenizers` at test time, never from this file). Deterministic; rerun after editing."""
import json
import os
import random

SCRIPTS = [
    "The quick brown fox jumps over the lazy dog. It's 5 o'clock; we'll see what they've done.",
    "我想在apple工作1314151天～ 今天天气很好，我们去公园散步吧！北京是中国的首都。",
    "日本語のテキスト：東京は日本の首都です。カタカナとひらがなを混ぜる。ｶﾀｶﾅ半角",
    "한국어 문장입니다. 서울은 대한민국의 수도입니다. 안녕하세요!",
    "العربية: مرحبا بالعالم! كيف حالك اليوم؟ ١٢٣٤٥٦٧٨٩٠",
    "हिन्दी: नमस्ते दुनिया। भारत की राजधानी नई दिल्ली है। ०१२३४५६७८९",
    "ไทย: สวัสดีชาวโลก ประเทศไทยมีกรุงเทพฯ เป็นเมืองหลวง",
    "ខ្មែរ: សួស្តីពិភពលោក ភ្នំពេញជារាជធានីនៃកម្ពុជា",
    "Русский: Привет, мир! Москва — столица России. ЁЛКА ёлка",
    "Ελληνικά: Γειά σου Κόσμε! Η Αθήνα είναι η πρωτεύουσα. ΣΊΣΥΦΟΣ ς",
    "עברית: שלום עולם! ירושלים.",
    "Tiếng Việt: Xin chào thế giới! Hà Nội là thủ đô của Việt Nam.",
    "Deutsch: Straße, Übermäßig, Größe. Français: œuvre, naïve, garçon, déjà vu.",
    "Türkçe: İstanbul, ışık, IĞDIR. Polski: zażółć gęślą jaźń.",
    "ქართული ენა, Հայերեն լեզու, አማርኛ ቋንቋ, தமிழ் மொழி, বাংলা ভাষা, ગુજરાતી",
    "Math: ∀x∈ℝ, x²≥0; ∑_{i=1}^{n} i = n(n+1)/2 ≈ ∞ ≠ ∅ ⊂ ⊆ ∫∮ √π ℵ₀",
]

CODE = [
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"hello %d\\n\", 42);\n\treturn 0;\n}\n",
    "for (let i = 0; i < arr.length; i++) { console.log(`${i}: ${arr[i]}`); } // done",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%smith%' ORDER BY id DESC;",
    "fn main() -> Result<(), Box<dyn Error>> {\r\n    let v: Vec<u8> = vec![0xFF; 16];\r\n    Ok(())\r\n}\r\n",
    "{\"key\": [1, 2.5, -3e10, true, null], \"nested\": {\"a\": \"b\"}}",
    "    indented\n        more\n\t\ttabs\n  \t mixed \t  \n\n\n   trailing   ",
    "<html><body><div class=\"x\">&amp; &lt;tag&gt;</div></body></html>",
    "$ ls -la | grep '^d' && echo \"done\" >> /tmp/log.txt 2>&1",
    "x=1;y=2;z=x+y*3/4-5%6**7//8",
]

WHITESPACE = [
    " ", "  ", "   ", "    ", " " * 17, "\t", "\t\t", "\n", "\n\n", "\r\n", "\r\n\r\n", " \n ", "\n \n",
    "a  b", "a   b", "a \t b", "a\t\tb", "a\r\nb", "a\rb", "a \r\n b", "end   ", "   start", " \t\n\r\x0b\x0c",
    "word\u00a0nbsp", "ideo\u3000space", "nel\u0085char", "line\u2028sep\u2029para", "zw\u200bsp\u200dj",
    "x" + " " * 100 + "y", "\n" * 40, "mixed \u00a0 \u3000 \t\n end",
]

DIGITS = [
    "0", "1", "12", "123", "1234", "12345", "123456", "1234567", "3333", "333", "33333333",
    "3.14159265358979", "1,234,567.89", "-42", "+7", "1e-10", "2024-11-29", "12:34:56", "v1.2.3",
    "0x1F2E3D", "1000000000000000000000000", "phone: +1 (555) 123-4567", "٣٤٥ ۴۵۶ ४५६ ๓๔๕ ①②③ ½ ¾ Ⅻ",
    "a1b22c333d4444e55555", "9" * 50,
]

EMOJI = [
    "😀", "😁 ?", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇺🇸🇯🇵", "❤️", "✌🏿 peace", "🧑🏻‍🤝‍🧑🏾",
    "emoji in text 🎉🎉🎉 party", "🙂🙃🤔🤷‍♀️🤷🏼‍♂️", "keycap 1️⃣ #️⃣", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 𝐁𝐨𝐥𝐝",
]

CONTRACTIONS = [
    "I'M HERE, YOU'RE THERE, SHE'S GONE, WE'LL SEE, THEY'VE LEFT, HE'D GO, DON'T",
    "I'm here, you're there, she's gone, we'll see, they've left, he'd go, don't",
    "iT'S mIxEd 'S 'LL 'Ll 'lL 'Re 'VE 'M 'D 'T", "'s'", "''", "'", "rock'n'roll", "o'clock ’s ’ll",
    "'ſ 'ſa Maſs", "’Twas the night", "y'all",
]

SPECIALS = [
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>",
    "text<|endoftext|>more text<|end_of_text|>", "<|im_sta", "<|im_start", "<|im_start|", "im_start|>",
    "<|<|im_start|>|>", "<|im_start|><|im_start|>", " <|im_end|> ", "<|reserved_special_token_5|>",
    "<think>\nreasoning\n</think>\n\nanswer", "<tool_call>{\"a\":1}</tool_call>", "<|fim_prefix|>x<|fim_suffix|>",
    "<mask> a <mask>b [SEP]   c [SEP]x  <both>  y qqword qqwordy aqqword qqword1 (qqword) café cafe\u0301 <|sp_norm|>",
]

NFC = [
    "cafe\u0301", "café", "e\u0301\u0302", "a\u0308\u0304", "\u1100\u1161\u11a8", "\u1100\u1161", "각\u11a8",
    "o\u0328\u0304", "A\u030a vs \u212b vs Å", "\u0b47\u0b3e", "Ω vs \u2126", "ﬁ ﬂ ﬀ", "①", "ｶ\uff9e",
    "s\u0323\u0307 vs \u1e69", "q\u0307\u0323", "\u0301leading mark", "x\u0300\u0316\u0301",
    "Zalgo: Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034da\u0351l\u0334g\u0315o",
    "ế ệ ầ ở ữ ợ", "é\u0300", "\u00c5\u0301",
]


def generated(rng):
    """Mixtures of the above with random glue, to get the cases at piece and special-token borders."""
    pool = SCRIPTS + CODE + WHITESPACE + DIGITS + EMOJI + CONTRACTIONS + SPECIALS + NFC
    glue = ["", " ", "  ", "\n", "\t", "\r\n", "'", "'s", "1", "22", "<|", "|>", "😀", "\u0301", ".", ","]
    texts = []
    for _ in range(400):
        parts = [rng.choice(pool) for _ in range(rng.randint(1, 4))]
        text = rng.choice(glue).join(parts)
        if rng.random() < 0.3:
            cut = rng.randint(0, len(text))
            text = text[:cut]
        texts.append(text)
    return texts


def main():
    rng = random.Random(20241129)
    texts = SCRIPTS + CODE + WHITESPACE + DIGITS + EMOJI + CONTRACTIONS + SPECIALS + NFC
    texts += [" ".join(SCRIPTS), "\n\n".join(CODE), "".join(EMOJI), "".join(SPECIALS)]
    texts += ["", "a", " a", "a ", "A" * 300, "🙂" * 100, "。" * 50, "-" * 120 + "\n"]
    texts += generated(rng)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus.jsonl")
    with open(out, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    print(f"wrote {len(texts)} texts, {os.path.getsize(out)} bytes to {out}")


if __name__ == "__main__":
    main()
