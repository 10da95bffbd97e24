"""qtune generate: greedy ids equal the PyTorch reference's greedy ids (tests/ref/qwen2_ref.py, full
recompute in float64) on random models, with and without a LoRA adapter; sampling is seeded and
respects top-k; the CLI refuses bad options."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import QTUNE, SRC, qtune

REF = os.path.join(SRC, "tests", "ref")
sys.path.insert(0, REF)
import st  # noqa: E402
from qwen2_ref import Qwen2Ref  # noqa: E402

_spec = importlib.util.spec_from_file_location("ref_helpers", os.path.join(REF, "conftest.py"))
ref_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref_helpers)

PROMPT = [5, 17, 42, 99, 3, 250, 7]
MAX_NEW = 12


def ref_greedy(ref, prompt, n):
    """Greedy continuation by full recompute; returns ids and, per step, the gap between the two
    largest logits (to tell a real mismatch from a float near-tie)."""
    ids, gaps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            lg = ref.logits([ids])[0, -1]
            top = torch.topk(lg, 2).values
            gaps.append(float(top[0] - top[1]))
            ids.append(int(torch.argmax(lg)))
    return ids[len(prompt):], gaps


def run_greedy(model, adapter=None, prompt=PROMPT, n=MAX_NEW):
    args = ["generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt)), "--temperature", "0",
            "--max-new", n, "--json"]
    if adapter:
        args += ["--adapter", adapter]
    p = qtune(*args, check=0)
    return json.loads(p.stdout.strip().splitlines()[-1])


def assert_same_greedy(got, want, gaps):
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            # allowed only where the reference itself has a near-tie; after it the sequences part
            assert gaps[i] < 1e-3, f"step {i}: qtune {g}, reference {w} (top-2 gap {gaps[i]:.3g})\n{got}\n{want}"
            return
    assert len(got) == len(want)


@pytest.mark.parametrize("shape", ["qwen2-gqa1-d64-tied-f32", "qwen2-gqa2-d64-untied-bf16"])
def test_greedy_matches_reference(tmp_path, shape):
    d = str(tmp_path / "m")
    ref_helpers.make_model(d, shape, seed=3)
    out = run_greedy(d)
    assert out["prompt_ids"] == PROMPT
    want, gaps = ref_greedy(Qwen2Ref(d), PROMPT, MAX_NEW)
    assert_same_greedy(out["ids"], want, gaps)
    assert out["stop"] == "max_new"


def write_adapter(d, cfg, r=4, alpha=8, targets=("q_proj", "v_proj"), seed=5):
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)
    C, H, KV = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or C // H
    out_dim = {"q_proj": H * D, "k_proj": KV * D, "v_proj": KV * D}
    w = {}
    for l in range(cfg["num_hidden_layers"]):
        for t in targets:
            key = "base_model.model.model.layers.%d.self_attn.%s" % (l, t)
            w[key + ".lora_A.weight"] = rng.normal(0, 1 / np.sqrt(C), (r, C)).astype(np.float32)
            # B non-zero (a trained adapter), large enough to change the greedy path
            w[key + ".lora_B.weight"] = rng.normal(0, 0.5, (out_dim[t], r)).astype(np.float32)
    st.write(os.path.join(d, "adapter_model.safetensors"), w, "F32")
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
                   "lora_dropout": 0.1, "target_modules": list(targets), "bias": "none", "use_rslora": False,
                   "base_model_name_or_path": ""}, f)
    return {"r": r, "alpha": alpha, "targets": list(targets), "rslora": False, "weights": w}


def test_greedy_with_adapter_matches_reference(tmp_path):
    d, a = str(tmp_path / "m"), str(tmp_path / "adapter")
    cfg = ref_helpers.make_model(d, "qwen2-gqa1-d64-tied-f32", seed=4)
    lora = write_adapter(a, cfg)
    out = run_greedy(d, a)
    want, gaps = ref_greedy(Qwen2Ref(d, lora=lora), PROMPT, MAX_NEW)
    assert_same_greedy(out["ids"], want, gaps)
    base, _ = ref_greedy(Qwen2Ref(d), PROMPT, MAX_NEW)
    assert want != base, "the adapter should change the greedy path (test would not tell)"


def test_sampling_is_seeded_and_top_k_1_is_greedy(tmp_path):
    d = str(tmp_path / "m")
    ref_helpers.make_model(d, "qwen2-gqa1-d64-tied-f32", seed=3)
    base = ["generate", "--model", d, "--prompt-ids", "1,2,3", "--max-new", 16, "--json"]
    a = json.loads(qtune(*base, "--temperature", "1.5", "--seed", "7", check=0).stdout)
    b = json.loads(qtune(*base, "--temperature", "1.5", "--seed", "7", check=0).stdout)
    c = json.loads(qtune(*base, "--temperature", "1.5", "--seed", "8", check=0).stdout)
    assert a["ids"] == b["ids"]
    assert a["ids"] != c["ids"]
    g = json.loads(qtune(*base, "--temperature", "0", check=0).stdout)
    k1 = json.loads(qtune(*base, "--temperature", "1.5", "--top-k", "1", "--seed", "9", check=0).stdout)
    p0 = json.loads(qtune(*base, "--temperature", "1.5", "--top-p", "1e-6", "--seed", "9", check=0).stdout)
    assert k1["ids"] == g["ids"] and p0["ids"] == g["ids"]
    # a temperature whose inverse overflows a float sampled the last id every time (NaN probabilities)
    for t in ("1e-40", "1e-45"):
        tiny = json.loads(qtune(*base, "--temperature", t, check=0).stdout)
        assert tiny["ids"] == g["ids"], t


def test_bad_options(tmp_path):
    d = str(tmp_path / "m")
    ref_helpers.make_model(d, "qwen2-gqa1-d64-tied-f32", seed=3)
    for extra in (["--temperature", "-1"], ["--top-p", "0"], ["--top-k", "-2"]):
        p = qtune("generate", "--model", d, "--prompt-ids", "1", *extra)
        assert p.returncode == 2 and extra[0] in p.stderr
    p = qtune("generate", "--model", d)
    assert p.returncode == 2 and "--prompt" in p.stderr
    for prompt in (["--prompt-ids", "1"], ["--prompts", os.path.join(d, "config.json")]):
        p = qtune("generate", "--model", d, *prompt, "--system", "be brief")  # was ignored in silence
        assert p.returncode == 2 and "--system TEXT is the system message of --chat" in p.stderr, p.stderr
    p = qtune("generate", "--model", d, "--prompt", "hi")  # no tokenizer.json in a reference folder
    assert p.returncode == 1 and "tokenizer" in p.stderr


def greedy(model, prompt, *extra, check=0):
    p = qtune("generate", "--model", model, "--prompt-ids", ",".join(map(str, prompt)), "--temperature", "0",
              "--json", *extra, check=check)
    return json.loads(p.stdout.strip().splitlines()[-1]) if check == 0 else p


def test_seed_range(tmp_path):
    """--seed takes every uint64 (qt_rng_seed's type) and nothing else: a negative, a value past
    2^64 - 1, a non-number or trailing text is a usage error, never a clamped or wrapped seed."""
    d = str(tmp_path / "m")
    ref_helpers.make_model(d, "qwen2-gqa1-d64-tied-f32", seed=3)
    base = ["generate", "--model", d, "--prompt-ids", "1,2,3", "--max-new", 16, "--json", "--temperature", "1.5"]
    for bad in ("-1", "-0", "18446744073709551616", "99999999999999999999", "abc", "5x", "", " 5", "+5", "1e3"):
        p = qtune(*base, "--seed", bad, check=2)
        assert "--seed" in p.stderr and "18446744073709551615" in p.stderr and p.stdout == "", (bad, p.stderr)
    # the top of the range: distinct seeds, distinct samples (strtoll clamped all three to 2^63 - 1)
    ids = {s: json.loads(qtune(*base, "--seed", s, check=0).stdout)["ids"]
           for s in ("9223372036854775807", "9223372036854775808", "18446744073709551615", "0")}
    assert len({tuple(v) for v in ids.values()}) == 4, ids


@pytest.mark.parametrize("ids", ["1,x", "", ",", "1,,2", "1,2,", ",1", "-1", "+1", "1 2", "1;2", "0x10",
                                 "2147483648", "99999999999999999999"])
def test_prompt_ids_checked_before_the_model_is_read(tmp_path, ids):
    """A malformed --prompt-ids is a usage error found before anything is read: the model folder
    given does not even exist, and the message is about the list, not the folder."""
    p = qtune("generate", "--model", str(tmp_path / "no-such-model"), "--prompt-ids", ids, check=2)
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and "--prompt-ids" in err[0] and "no-such-model" not in err[0], p.stderr


def test_prompt_ids_against_the_vocabulary(tmp_path):
    d = str(tmp_path / "m")
    cfg = ref_helpers.make_model(d, "qwen2-gqa1-d64-tied-f32", seed=3)
    V = cfg["vocab_size"]
    p = greedy(d, [1, V, 2], check=2)
    assert "--prompt-ids" in p.stderr and str(V) in p.stderr and "vocab_size" in p.stderr
    # spaces around the commas are fine, and the last id of the vocabulary is one
    out = greedy(d, [" 1 ", " %d" % (V - 1)], "--max-new", 2)
    assert out["prompt_ids"] == [1, V - 1] and len(out["ids"]) == 2


def test_ctx_boundary(tmp_path):
    """--ctx N: the prompt and the reply together hold at most N tokens, and exactly N when neither
    an end token nor --max-new stops it first; the last one is the true greedy token at position
    N - 1 (the reference's), and --ctx past max_position_embeddings is refused."""
    d = str(tmp_path / "m")
    cfg = ref_helpers.make_model(d, "qwen2-gqa1-d64-tied-f32", seed=3)
    cfg["max_position_embeddings"] = 16
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    prompt = [5, 17, 42]
    # default --ctx = max_position_embeddings here: 16 - 3 new tokens, the last at position 15
    out = greedy(d, prompt, "--max-new", 100)
    assert out["stop"] == "context" and len(prompt) + len(out["ids"]) == 16, out
    want, gaps = ref_greedy(Qwen2Ref(d), prompt, 13)
    assert_same_greedy(out["ids"], want, gaps)
    assert greedy(d, prompt, "--ctx", 16, "--max-new", 100)["ids"] == out["ids"]
    # a smaller --ctx cuts the same sequence at exactly N tokens
    for ctx in (2, 4, 8, 15):
        o = greedy(d, prompt[:min(3, ctx - 1)], "--ctx", ctx, "--max-new", 100)
        assert o["stop"] == "context" and len(o["prompt_ids"]) + len(o["ids"]) == ctx, (ctx, o)
    o = greedy(d, prompt, "--ctx", 8, "--max-new", 100)
    assert o["ids"] == out["ids"][:5]
    # --max-new reaching the same length stops first; one more and the context does
    assert greedy(d, prompt, "--ctx", 8, "--max-new", 5)["stop"] == "max_new"
    o = greedy(d, prompt, "--ctx", 8, "--max-new", 6)
    assert o["stop"] == "context" and len(o["ids"]) == 5
    # a prompt of N - 1 tokens gets exactly one; a prompt of N leaves no room
    o = greedy(d, list(range(1, 8)), "--ctx", 8, "--max-new", 100)
    assert o["stop"] == "context" and len(o["ids"]) == 1
    p = greedy(d, list(range(1, 9)), "--ctx", 8, check=1)
    assert "no room" in p.stderr and "--ctx" in p.stderr and "8 tokens" in p.stderr, p.stderr
    assert "the model takes up to 16" in p.stderr, p.stderr
    p = greedy(d, list(range(1, 17)), check=1)  # the default context, max_position_embeddings 16
    # no --ctx can hold it: the advice is to shorten the prompt, not to raise --ctx past the model's limit
    assert "no room" in p.stderr and "shorten the prompt to at most 15 tokens" in p.stderr, p.stderr
    assert "raise --ctx" not in p.stderr, p.stderr
    # --ctx may not pass max_position_embeddings: a usage error naming both
    p = greedy(d, prompt, "--ctx", 17, check=2)
    assert "--ctx 17" in p.stderr and "max_position_embeddings" in p.stderr and "16" in p.stderr, p.stderr
    # past qtune's own bound the sentence said only ">= 2", which 5000000 is
    p = greedy(d, prompt, "--ctx", 5000000, check=2)
    assert "from 2 to 4194304" in p.stderr and "'5000000'" in p.stderr, p.stderr


@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_nonfinite_logits_are_an_error(tmp_path, bad):
    """Weights holding NaN or inf make the logits non-finite; generate stops with one sentence naming
    the model folder instead of printing ids sampled from them (argmax of NaN was id 0)."""
    d = str(tmp_path / "m")
    ref_helpers.make_model(d, "qwen2-gqa1-d64-tied-f32", seed=3)
    path = os.path.join(d, "model.safetensors")
    w = {k: np.asarray(v, dtype=np.float32) for k, v in st.read(path).items()}
    w["model.norm.weight"][3] = float(bad)
    st.write(path, w, "F32")
    for extra in (["--temperature", "0", "--json"], ["--temperature", "1", "--top-p", "0.9"]):
        p = qtune("generate", "--model", d, "--prompt-ids", "1,2,3", "--max-new", 4, *extra, check=1)
        err = p.stderr.strip().splitlines()
        assert len(err) == 1 and d in err[0] and "non-finite logit" in err[0], p.stderr
        assert ("NaN" if bad == "nan" else "inf") in err[0] and p.stdout == "", p.stdout


@pytest.mark.parametrize("mode", [["--prompt-ids", "1,2,3"], ["--prompt-ids", "1,2,3", "--json"], ["--prompts"]])
def test_write_error_is_an_error(tmp_path, mode):
    """stdout on a full disk (/dev/full): the reply is lost, so generate stops with one sentence and
    exit 1 (it printed into the void and exited 0)."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    d = str(tmp_path / "m")
    ref_helpers.make_model(d, "qwen2-gqa1-d64-tied-f32", seed=3)
    if mode == ["--prompts"]:
        f = str(tmp_path / "p.jsonl")
        with open(f, "w") as fh:
            fh.write('{"prompt_ids": [1, 2]}\n{"prompt_ids": [3]}\n')
        mode = ["--prompts", f, "--batch", "2"]
    with open("/dev/full", "w") as full:
        p = subprocess.run([QTUNE, "generate", "--model", d, *mode, "--max-new", "8"], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=600)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(err) == 1 and "cannot write the reply to standard output" in err[0], p.stderr


def test_too_many_threads_is_refused(tmp_path):
    """OMP_NUM_THREADS=70000 crashed inside libgomp (SIGSEGV: the threads' start data overflowed the
    stack); more than 4096 threads is now one sentence and exit 2, before the model is read."""
    d = str(tmp_path / "m")
    ref_helpers.make_model(d, "qwen2-gqa1-d64-tied-f32", seed=3)
    p = qtune("generate", "--model", d, "--prompt-ids", "1,2", "--max-new", 2, env={"OMP_NUM_THREADS": "70000"})
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1 and "OMP_NUM_THREADS asks for 70000 threads" in err[0], p.stderr
    assert qtune("generate", "--model", d, "--prompt-ids", "1,2", "--max-new", 2, "--json",
                 env={"OMP_NUM_THREADS": "3"}).returncode == 0


def test_every_eos_id_stops(tmp_path):
    """eos_token_id as a list (Llama 3.1 writes [128001, 128008, 128009]) and generation_config.json's own
    list (which Hugging Face's generate reads first): every id ends the reply. qtune kept only the first id
    of config.json, so a reply ran past <|eot_id|> to --max-new. A broken generation_config.json is named
    before the weights are read."""
    d = str(tmp_path / "m")
    cfg = ref_helpers.make_model(d, "qwen2-gqa1-d64-tied-f32", seed=3)
    base = ["generate", "--model", d, "--prompt-ids", "5,17,42", "--temperature", "0", "--max-new", 12, "--json"]
    free = json.loads(qtune(*base, check=0).stdout)["ids"]
    firsts = [k for k in range(len(free)) if free[k] not in free[:k]]  # steps where a new id first comes
    assert len(firsts) >= 2, free
    late, early = firsts[-1], firsts[-2]
    cfg["eos_token_id"] = [cfg["vocab_size"] - 1, free[late]]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    out = json.loads(qtune(*base, check=0).stdout)
    assert out["ids"] == free[:late] and out["stop"] == "eos", out
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [cfg["vocab_size"] - 2, free[early]]}, f)
    out = json.loads(qtune(*base, check=0).stdout)
    assert out["ids"] == free[:early] and out["stop"] == "eos", out
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        f.write('{"eos_token_id": "x"}')
    p = qtune(*base, check=1)
    assert "generation_config.json: eos_token_id must be a token id" in p.stderr, p.stderr
