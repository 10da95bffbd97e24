"""A JSONL file of about MB megabytes for the data-cache figures of docs/data.md:
random English-like words with some accented and CJK words, 20-600 words a
line, `text` format or `messages` (one user and one assistant turn, the text
split at a third). Deterministic (seed 1).

    /usr/bin/python3 bench/gen_data_jsonl.py OUT.jsonl MB [text|messages]
"""
import json, random, sys
random.seed(1)
words = ("the of and to in is was for on that with as by at from it an be this which or are have not had "
         "model training data token language fine tune learning rate gradient batch layer attention weight "
         "Qwen transformer loss optimizer memory compute parallel rank shard cache loader example sequence "
         "über naïve café 東京 数据 模型 训练 123 4567 2026 x86 GPU CPU").split()
out, target = sys.argv[1], int(float(sys.argv[2]) * 1e6)
kind = sys.argv[3] if len(sys.argv) > 3 else "text"
n = 0
with open(out, "w") as f:
    while n < target:
        k = random.randint(20, 600)
        s = " ".join(random.choice(words) for _ in range(k))
        s = s[0].upper() + s[1:] + "."
        if kind == "text":
            line = json.dumps({"text": s}, ensure_ascii=False)
        else:
            cut = len(s) // 3
            line = json.dumps({"messages": [{"role": "user", "content": s[:cut]}, {"role": "assistant", "content": s[cut:]}]}, ensure_ascii=False)
        f.write(line + "\n")
        n += len(line.encode()) + 1
