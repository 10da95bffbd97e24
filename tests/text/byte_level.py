"""GPT-2's byte alphabet (bytes_to_unicode), which byte-level BPE vocabularies spell their tokens in: the
printable bytes stand for themselves, the others for code points from 256 on, in byte order. Shared by the
tiktoken parity test and the GGUF export test."""


def bytes_to_unicode():
    """{byte: the character that spells it}."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
