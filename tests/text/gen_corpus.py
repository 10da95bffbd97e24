"""Deterministic tokenizer parity corpus (bytes, not str: it holds invalid UTF-8).

    /usr/bin/python3 tests/text/gen_corpus.py OUT [--mb 2.2] [--seed 1] [--parity-safe] [--zh-en]

Mixes English prose (from /usr/share/doc and the Python standard library's
docstrings), Python source, Chinese (fixed sentences plus runs of common
ideographs), numbers, whitespace runs, emoji, special tokens written inline,
random code points from many scripts (with combining marks, so NFC has work)
and invalid UTF-8. --zh-en makes the benchmark text instead: the English
messages of the machine's zh_CN gettext catalogs each followed by its Chinese
translation (real mixed text), or, without catalogs, English prose and
generated Chinese. The same seed on the same machine gives the same bytes.

--parity-safe leaves out the three characters where the JS reference
(@lenml/tokenizers) differs from HF tokenizers by design of the JS regex
engine: U+0085 and U+FEFF (JS's \\s differs from Oniguruma's) and "'" + U+017F
(JS's case-insensitive group is rewritten to ASCII classes). qtune follows
HF on those; tests/unit/text checks them separately.
"""
import gettext
import glob
import os
import random
import sys

CHINESE = [
    "今天天气很好，我们一起去公园散步吧。",
    "机器学习是人工智能的一个分支，它使计算机能够从数据中学习。",
    "通义千问是阿里云研发的大语言模型，支持中文和英文。",
    "请把这段代码翻译成Python，并解释每一行的作用。",
    "他说：“明天上午九点在会议室开会，不要迟到！”",
    "北京、上海、广州和深圳是中国的一线城市。",
    "这个模型有140亿个参数，训练用了3.5万亿个词元。",
    "床前明月光，疑是地上霜。举头望明月，低头思故乡。",
    "我们在2024年12月31日发布了新版本（v2.5.1），修复了若干问题。",
    "深度学习框架：PyTorch、TensorFlow、JAX；优化器：AdamW。",
    "你好！请问有什么可以帮您？😊",
    "微调（fine-tuning）通常只需要少量的标注数据。",
]
ENGLISH = [
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll like it; they've said it's what we'd need. DON'T WORRY, I'LL BE THERE.",
    "Mr. O'Neil's 3rd-quarter results: revenue up 12.5% to $4,567,890.12 (vs. $4.06M).",
    "e-mail: someone@example.com, URL: https://example.org/path?q=a+b&x=1#frag",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|box_end|>",
            "<|vision_pad|>", "<tool_call>", "</tool_call>", "<think>", "</think>", "<|fim_prefix|>",
            "<|im_sta", "<|im_end|", "im_end|>", "<<|im_end|>>", "<|endoftext|><|endoftext|>", "< think>"]
EMOJI = ["😀", "😂", "🤖", "🚀", "👍🏽", "👨‍👩‍👧‍👦", "🇨🇳", "🇺🇸", "❤️", "✨", "🔥", "🙏", "🧑🏻‍💻", "☕", "1️⃣", "©", "™"]
SCRIPTS = [
    (0x00C0, 0x024F), (0x0370, 0x03FF), (0x0400, 0x04FF), (0x0530, 0x058F), (0x05D0, 0x05EA),
    (0x0620, 0x064A), (0x0900, 0x097F), (0x0E01, 0x0E5B), (0x10A0, 0x10FF), (0x1E00, 0x1EFF),
    (0x3041, 0x3096), (0x30A1, 0x30FA), (0xAC00, 0xD7A3), (0x2100, 0x214F), (0x2190, 0x21FF),
    (0x2200, 0x22FF), (0x2500, 0x257F), (0xFF01, 0xFF5E), (0x1D400, 0x1D4FF), (0x20000, 0x2A6D6),
]
COMBINING = [0x0300, 0x0301, 0x0302, 0x0303, 0x0308, 0x030A, 0x0327, 0x0323, 0x0338, 0x3099, 0x309A]
WHITESPACE = [" ", "  ", "    ", "\t", "\n", "\n\n", "\r\n", " \n", "   \n  ", "\n\n\n", "\t\t\n",
              "\u3000", "\u00a0", "\u2003", " \u00a0 ", "\u2028", "\x0b", "\x0c"]
INVALID = [b"\xff", b"\xfe\xfe", b"\xc0\x80", b"\xc3", b"\xe4\xb8", b"\xe4\xb8\x41", b"\x80\x80",
           b"\xed\xa0\x80", b"\xf0\x9f\x98", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xc2\x41"]


def english_sources():
    files = sorted(glob.glob("/usr/share/doc/*/copyright"))[:400]
    files += sorted(glob.glob("/usr/share/doc/*/README*"))[:50]
    out = []
    for f in files:
        try:
            with open(f, "rb") as fh:
                b = fh.read(20000)
            out.append(b.decode("utf-8", "replace"))
        except OSError:
            pass
    return out


def code_sources():
    files = sorted(glob.glob("/usr/lib/python3*/*.py"))
    out = []
    for f in files:
        try:
            with open(f, "rb") as fh:
                out.append(fh.read(30000).decode("utf-8", "replace"))
        except OSError:
            pass
    return out


def translation_pairs():
    """(English, Chinese) message pairs from the machine's zh_CN gettext catalogs:
    real Chinese, mixed with English the way software text is."""
    pairs = []
    for f in sorted(glob.glob("/usr/share/locale/zh_CN/LC_MESSAGES/*.mo")):
        try:
            with open(f, "rb") as fh:
                cat = gettext.GNUTranslations(fh)._catalog
        except Exception:  # a catalog Python cannot read is simply left out
            continue
        for k in sorted(cat, key=str):
            en = k[0] if isinstance(k, tuple) else k
            zh = cat[k]
            if en and zh and en != zh:
                pairs.append((en, zh))
    return pairs


def chinese_run(r, n):
    s = []
    for _ in range(n):
        if r.random() < 0.12:
            s.append(r.choice("，。、！？；：“”（）《》"))
        else:
            s.append(chr(r.randint(0x4E00, 0x9FA5)))
    return "".join(s)


def number(r):
    k = r.randint(0, 6)
    if k == 0:
        return str(r.randint(0, 10 ** r.randint(1, 12)))
    if k == 1:
        return f"{r.uniform(-1e4, 1e4):.{r.randint(0, 6)}f}"
    if k == 2:
        return f"{r.randint(1990, 2030)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
    if k == 3:
        return f"+86 {r.randint(130, 199)} {r.randint(1000, 9999)} {r.randint(1000, 9999)}"
    if k == 4:
        return f"{r.random():.3e}"
    if k == 5:
        return "".join(chr(r.randint(0xFF10, 0xFF19)) for _ in range(r.randint(1, 6)))  # fullwidth digits
    return "٣٤٥" if r.random() < 0.5 else "Ⅻ½²³"


def random_unicode(r, n, safe):
    out = []
    for _ in range(n):
        lo, hi = r.choice(SCRIPTS)
        c = chr(r.randint(lo, hi))
        out.append(c)
        if r.random() < 0.15:
            out.append(chr(r.choice(COMBINING)))
        if r.random() < 0.1:
            out.append(" ")
    if not safe and r.random() < 0.3:
        out.append(r.choice(["\u0085", "\ufeff", "'\u017f"]))
    return "".join(out)


def excerpt(r, texts, lo, hi):
    t = r.choice(texts)
    if not t:
        return ""
    a = r.randint(0, max(0, len(t) - 1))
    return t[a:a + r.randint(lo, hi)]


def generate(size, seed, safe):
    r = random.Random(seed)
    prose, code = english_sources(), code_sources()
    if not prose:
        prose = ENGLISH
    if not code:
        code = ["def f(x):\n    return x * 2  # double\n"]
    parts, total = [], 0
    while total < size:
        k = r.random()
        if k < 0.22:
            s = excerpt(r, prose, 200, 3000)
        elif k < 0.36:
            s = excerpt(r, code, 200, 3000)
        elif k < 0.52:
            s = "".join(r.choice(CHINESE) if r.random() < 0.5 else chinese_run(r, r.randint(2, 40))
                        for _ in range(r.randint(1, 12)))
        elif k < 0.60:
            s = " ".join(number(r) for _ in range(r.randint(1, 12)))
        elif k < 0.66:
            s = "".join(r.choice(WHITESPACE) + r.choice(["x", "中", "1", "!", "", "ab"]) for _ in range(r.randint(1, 20)))
        elif k < 0.71:
            s = "".join(r.choice(EMOJI) + r.choice(["", " ", "a", "好", "\n"]) for _ in range(r.randint(1, 15)))
        elif k < 0.77:
            s = r.choice(SPECIALS) + r.choice([" ", "", "\n", "user\n", "assistant\n"]) + r.choice(CHINESE + ENGLISH)
        elif k < 0.84:
            s = random_unicode(r, r.randint(5, 120), safe)
        elif k < 0.90:
            s = r.choice(ENGLISH) + " " + r.choice(CHINESE) + number(r) + r.choice(EMOJI)
        else:
            b = r.choice(ENGLISH).encode() + r.choice(INVALID) + r.choice(CHINESE).encode()
            parts.append(b + r.choice(INVALID))
            total += len(parts[-1])
            continue
        b = (s + r.choice(["", " ", "\n", "\n\n", "  "])).encode("utf-8", "surrogatepass")
        parts.append(b)
        total += len(b)
    return b"".join(parts)


def generate_zh_en(size, seed):
    pairs = translation_pairs()
    if pairs:  # real text: each English message and its Chinese translation, in catalog order
        parts, total, i = [], 0, 0
        while total < size:
            en, zh = pairs[i % len(pairs)]
            b = (en + "\n" + zh + "\n\n").encode("utf-8", "surrogatepass")
            parts.append(b)
            total += len(b)
            i += 1
        return b"".join(parts)
    r = random.Random(seed)
    prose = english_sources() or ENGLISH
    parts, total = [], 0
    while total < size:
        if r.random() < 0.5:
            s = excerpt(r, prose, 200, 2000)
        else:
            s = "".join(r.choice(CHINESE) if r.random() < 0.6 else chinese_run(r, r.randint(2, 30))
                        for _ in range(r.randint(3, 30)))
        b = (s + r.choice(["\n", "\n\n", " "])).encode()
        parts.append(b)
        total += len(b)
    return b"".join(parts)


def main():
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        sys.exit(2)
    out = args[0]
    mb = float(args[args.index("--mb") + 1]) if "--mb" in args else 2.2
    seed = int(args[args.index("--seed") + 1]) if "--seed" in args else 1
    if "--zh-en" in args:
        data = generate_zh_en(int(mb * 1024 * 1024), seed)
    else:
        data = generate(int(mb * 1024 * 1024), seed, "--parity-safe" in args)
    with open(out + ".tmp", "wb") as f:
        f.write(data)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main()
