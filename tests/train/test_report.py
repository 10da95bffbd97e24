"""report.html, the training dashboard, in a real headless Chromium (Debian's
chromium): it loads without errors and draws its charts from the
metrics.jsonl lines it embeds; and the TensorBoard event files that
train.report_to "tensorboard" writes, read back by TensorBoard's event-file
rules (TFRecord framing with masked CRC-32C, Event protos decoded by
python3-protobuf from TensorBoard's field numbers, written out here).

QTUNE_REPORT_SCREENSHOT=DIR also leaves report.png (desktop) and
report-phone.png (a phone's width) of the run in DIR (docs/ has them)."""
import html.parser
import json
import math
import os
import re
import shutil
import struct
import subprocess

import pytest

from trainutil import metrics, run, write_job, write_tokens, init_model

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
NO_BROWSER = ("no chromium on PATH: the report tests need Debian's chromium "
              "(apt-get install chromium; .ci/run installs it)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]
STEPS = 24


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """LoRA in fp16 from a 2^24 loss scale (the first steps overflow and are
    skipped), a warmup-and-decay schedule, an eval every 6 steps, TensorBoard on."""
    d = str(tmp_path_factory.mktemp("report"))
    init_model(os.path.join(d, "model"))
    write_tokens(os.path.join(d, "train.jsonl"), 40, 16, seed=1, min_len=4)
    write_tokens(os.path.join(d, "eval.jsonl"), 8, 16, seed=2)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 6, "total_num_steps": STEPS}},
          "fp16": {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 4, "hysteresis": 1}}
    j = write_job(os.path.join(d, "job.json"), "model", "out", "train.jsonl", eval_="eval.jsonl",
                  lora={"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
                  train_opts={"max_steps": STEPS, "eval_steps": 6, "report_to": "tensorboard"}, ds=ds)
    run("train", j)
    return os.path.join(d, "out")


def embedded(path):
    text = open(path, encoding="utf-8").read()
    m = re.search(r'<script id="qtune-data" type="application/json">(.*?)</script>', text, re.S)
    assert m, "report.html has no embedded data"
    return text, json.loads(m.group(1))


def test_report_is_self_contained_and_embeds_metrics(out):
    text, data = embedded(os.path.join(out, "report.html"))
    lines = metrics(out)
    # every metrics.jsonl line, as written, in order
    assert data["rows"] == lines and data["rows_total"] == len(lines) and data["stride"] == 1
    assert data["status"] == "finished" and data["max_steps"] == STEPS
    assert data["plan"]["rank_bytes"] > 0 and data["plan"]["device_bytes"] > 0
    assert data["device"].startswith("cpu")
    # nothing loaded from anywhere: no src/href attributes, no url(), no fetch
    assert not re.search(r"\b(src|href)\s*=", text), "report.html references another file"
    assert "url(" not in text and "@import" not in text and "fetch(" not in text and "XMLHttpRequest" not in text
    assert not [n for n in os.listdir(out) if n.startswith("report.html.tmp")]


def chromium(args, url, tmp):
    """Chromium's output, with a fresh profile each time; console messages on stderr."""
    prof = os.path.join(str(tmp), "profile-%d" % len(os.listdir(str(tmp))))
    p = subprocess.run([CHROMIUM] + FLAGS + ["--user-data-dir=" + prof, "--enable-logging=stderr", "--v=0"] + args +
                       [url], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    console = [l for l in p.stderr.splitlines() if "CONSOLE" in l or "Uncaught" in l]
    return p.stdout, console


class Dom(html.parser.HTMLParser):
    """Every element of the dumped DOM as (tag, attrs, text)."""
    def __init__(self, text):
        super().__init__()
        self.els, self.stack = [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        e = [tag, dict(attrs), ""]
        self.els.append(e)
        if tag not in ("line", "path", "circle", "rect", "polyline", "meta", "br", "i"):
            self.stack.append(e)

    def handle_startendtag(self, tag, attrs):
        self.els.append([tag, dict(attrs), ""])

    def handle_endtag(self, tag):
        while self.stack and self.stack.pop()[0] != tag:
            pass

    def handle_data(self, data):
        for e in self.stack:
            e[2] += data

    def find(self, tag=None, **attrs):
        return [e for e in self.els if (tag is None or e[0] == tag) and
                all(e[1].get(k.replace("_", "-")) == v for k, v in attrs.items())]


def charts(dom):
    """{card id: [its elements]} in document order."""
    out, cur = {}, None
    for e in dom.els:
        if e[0] == "div" and e[1].get("class") == "card":
            cur = e[1]["id"][len("card-"):]
            out[cur] = []
        elif cur:
            out[cur].append(e)
    return out


def fin(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.skipif(not CHROMIUM, reason=NO_BROWSER)
def test_report_draws_its_charts_from_the_metrics(out, tmp_path):
    page = "file://" + os.path.join(out, "report.html")
    dumped, console = chromium(["--window-size=1280,1300", "--dump-dom"], page, tmp_path)
    assert not console, "console messages: %s" % console
    dom = Dom(dumped)
    body = dom.find("body")[0][1]
    assert body.get("data-rendered") == "1" and "data-error" not in body, body
    lines = metrics(out)
    train = [m for m in lines if "eval_loss" not in m]
    evals = [m for m in lines if "eval_loss" in m]
    skipped = [m["step"] for m in train if m["skipped"]]
    assert skipped and len(skipped) < len(train), "the run should skip some steps, not all"
    cs = charts(dom)
    assert sorted(cs) == sorted(["loss", "lr", "grad_norm", "loss_scale", "tokens_per_s", "memory"])
    want = {("loss", "loss"): train, ("loss", "eval_loss"): evals, ("lr", "lr"): train,
            ("grad_norm", "grad_norm"): train, ("loss_scale", "loss_scale"): train,
            ("tokens_per_s", "tokens_per_s"): train, ("memory", "mem_peak_bytes"): train}
    for (card, key), rows in want.items():
        lines_ = [e for e in cs[card] if e[0] == "polyline" and e[1].get("data-key") == key]
        assert len(lines_) == 1, (card, key)
        a = lines_[0][1]
        pts = [(s, m[key]) for s, m in ((m["step"], m) for m in rows) if fin(m[key])]
        assert int(a["data-n"]) == len(pts), (card, key)
        assert [int(s) for s in a["data-steps"].split(",")] == [s for s, _ in pts], (card, key)
        got = [float(v) for v in a["data-values"].split(",")]
        assert got == pytest.approx([v for _, v in pts], rel=1e-12), (card, key)
        # the drawn points are those values on the chart's axes
        svg = [e for e in cs[card] if e[0] == "svg"][0][1]
        x0, x1, y0, y1 = (float(svg[k]) for k in ("data-x0", "data-x1", "data-y0", "data-y1"))
        left, right, top, bot = (float(svg[k]) for k in ("data-l", "data-r", "data-t", "data-b"))
        xy = [tuple(map(float, p.split(","))) for p in a["points"].split()]
        if card == "loss_scale":  # a step line in log2: each value held until the next, two points a step
            xy = xy[:1] + xy[2::2]
        assert len(xy) == len(pts)
        unit = {"memory": 2.0 ** 30 if max(v for _, v in pts) >= 2 ** 30 else 2.0 ** 20}.get(card, 1.0)
        for (s, v), (px, py) in zip(pts, xy):
            assert px == pytest.approx(left + (s - x0) / (x1 - x0) * (right - left), abs=0.02)
            y = math.log2(v) if card == "loss_scale" else v / unit
            assert py == pytest.approx(bot - (y - y0) / (y1 - y0) * (bot - top), abs=0.02), (card, s)
    # eval points as dots; skipped steps marked where the page draws them
    assert len([e for e in cs["loss"] if e[0] == "circle"]) == len(evals)
    for card in ("loss", "grad_norm", "loss_scale"):
        assert [int(e[1]["data-step"]) for e in cs[card] if e[0] == "path"] == skipped, card
    # memory against the plan: the dashed line at the plan's bytes
    _, data = embedded(os.path.join(out, "report.html"))
    hl = [e for e in cs["memory"] if e[0] == "line" and e[1].get("class") == "hline"]
    assert len(hl) == 1
    assert float(hl[0][1]["data-y"]) * unit == pytest.approx(data["plan"]["rank_bytes"], rel=1e-9)
    # the tiles say the same as the lines
    tiles = {e[1]["data-key"]: e[2] for e in dom.find("div") if e[1].get("class", "").startswith("tile")}
    assert tiles["step"].startswith("Step%d / %d" % (STEPS, STEPS))
    assert tiles["skipped"].startswith("Skipped steps%d" % len(skipped))
    assert "%.4g" % evals[-1]["eval_loss"] in tiles["eval_loss"]
    assert "done" in tiles["eta"]
    assert dom.find("span", id="status")[0][2] == "finished"


@pytest.mark.skipif(not CHROMIUM, reason=NO_BROWSER)
def test_report_fits_a_phone_and_reloads_while_running(out, tmp_path):
    """A phone's width: nothing wider than the screen; a page
    whose run is live reloads itself, a finished one does not."""
    text = open(os.path.join(out, "report.html"), encoding="utf-8").read()
    # the page's timers, recorded instead of run: a live page asks for a reload in refresh_s seconds
    timers = ('<body data-rendered="0"><script>var qtSetTimeout = window.setTimeout; window.setTimeout = '
              'function (f, ms) { if (String(f).indexOf("location.reload") >= 0) '
              'document.body.dataset.reload = ms; return 0; };</script>')
    probe = ("<script>qtSetTimeout(function(){document.body.dataset.scrollw=document.documentElement.scrollWidth;"
             "document.body.dataset.innerw=innerWidth;},0);</script></body>")
    for status in ("finished", "running"):
        page = os.path.join(str(tmp_path), "report-%s.html" % status)
        t = text.replace('"status":"finished"', '"status":"%s"' % status)
        t = t.replace('<body data-rendered="0">', timers, 1).replace("</body>", probe, 1)
        open(page, "w", encoding="utf-8").write(t)
        dumped, console = chromium(["--window-size=390,844", "--dump-dom"], "file://" + page, tmp_path)
        assert not console, console
        body = Dom(dumped).find("body")[0][1]
        assert body["data-rendered"] == "1" and "data-error" not in body
        # headless Chromium lays out at least 500 pixels wide: below the page's 560-pixel phone layout
        assert int(body["data-innerw"]) <= 560 and int(body["data-scrollw"]) <= int(body["data-innerw"]), body
        assert body.get("data-reload") == ("15000" if status == "running" else None), (status, body)
    shots = os.environ.get("QTUNE_REPORT_SCREENSHOT") or str(tmp_path)
    for name, size in (("report.png", "1280,1160"), ("report-phone.png", "500,2060")):
        png = os.path.join(shots, name)
        chromium(["--window-size=" + size, "--screenshot=" + png], "file://" + os.path.join(out, "report.html"),
                 tmp_path)
        head = open(png, "rb").read(24)
        assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">I", head[16:20])[0] == int(size.split(",")[0])


# --------------------------------------------------------------------------
# TensorBoard: the event-file format as TensorBoard reads it

def crc32c(data):
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def masked(data):
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def event_class():
    """Event, Summary and Summary.Value with the field numbers of TensorBoard's
    event.proto and summary.proto (tensorboard/compat/proto/), the scalar part."""
    pb = pytest.importorskip("google.protobuf", reason="python3-protobuf is needed to decode the events")
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    F = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(name="tb_test.proto", package="tensorboard", syntax="proto3")
    ev = fd.message_type.add(name="Event")
    ev.field.add(name="wall_time", number=1, type=F.TYPE_DOUBLE, label=F.LABEL_OPTIONAL)
    ev.field.add(name="step", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    ev.field.add(name="file_version", number=3, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    ev.field.add(name="summary", number=5, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL, type_name=".tensorboard.Summary")
    su = fd.message_type.add(name="Summary")
    su.field.add(name="value", number=1, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED,
                 type_name=".tensorboard.Summary.Value")
    va = su.nested_type.add(name="Value")
    va.field.add(name="node_name", number=7, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    va.field.add(name="tag", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    va.field.add(name="simple_value", number=2, type=F.TYPE_FLOAT, label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    desc = pool.FindMessageTypeByName("tensorboard.Event")
    if hasattr(message_factory, "GetMessageClass"):
        return message_factory.GetMessageClass(desc)
    return message_factory.MessageFactory(pool).GetPrototype(desc)


def read_events(path):
    """The Event messages of one file, each record's length and data CRCs checked."""
    Event = event_class()
    data, pos, out = open(path, "rb").read(), 0, []
    while pos < len(data):
        assert len(data) - pos >= 12, "a truncated record header at byte %d" % pos
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        (lcrc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        assert lcrc == masked(data[pos:pos + 8]), "length CRC at byte %d" % pos
        body = data[pos + 12:pos + 12 + n]
        (dcrc,) = struct.unpack("<I", data[pos + 12 + n:pos + 16 + n])
        assert len(body) == n and dcrc == masked(body), "data CRC at byte %d" % pos
        e = Event()
        e.ParseFromString(body)
        out.append(e)
        pos += 16 + n
    return out


def scalars(events):
    s = {}
    for e in events:
        for v in e.summary.value:
            s.setdefault(v.tag, []).append((e.step, v.simple_value))
    return s


def test_crc32c_known_value():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_tensorboard_events_hold_the_metrics(out):
    runs = os.listdir(os.path.join(out, "runs"))
    assert len(runs) == 1 and re.fullmatch(r"[A-Z][a-z]{2}\d\d_\d\d-\d\d-\d\d_.+", runs[0]), runs
    folder = os.path.join(out, "runs", runs[0])
    files = os.listdir(folder)
    assert len(files) == 1 and files[0].startswith("events.out.tfevents."), files
    events = read_events(os.path.join(folder, files[0]))
    assert events[0].file_version == "brain.Event:2" and events[0].wall_time > 1.6e9
    assert all(e.wall_time >= events[0].wall_time for e in events)
    s = scalars(events[1:])
    lines = metrics(out)
    train = [m for m in lines if "eval_loss" not in m]
    evals = [m for m in lines if "eval_loss" in m]
    f32 = lambda x: struct.unpack("<f", struct.pack("<f", x))[0]  # noqa: E731
    for tag, key in (("train/loss", "loss"), ("train/learning_rate", "lr"), ("train/grad_norm", "grad_norm"),
                     ("train/epoch", "epoch"), ("train/loss_scale", "loss_scale"),
                     ("train/tokens_per_s", "tokens_per_s")):
        want = [(m["step"], f32(m[key])) for m in train if fin(m[key])]
        # float32 of the double, which metrics.jsonl prints to 9 digits: within one float32 step
        assert [st for st, _ in s[tag]] == [st for st, _ in want], tag
        assert [v for _, v in s[tag]] == pytest.approx([v for _, v in want], rel=1.2e-7), tag
    assert s["train/skipped"] == [(m["step"], float(m["skipped"])) for m in train]
    assert [st for st, _ in s["eval/loss"]] == [m["step"] for m in evals]
    assert [v for _, v in s["eval/loss"]] == pytest.approx([m["eval_loss"] for m in evals], rel=1.2e-7)
    assert [st for st, _ in s["eval/ppl"]] == [m["step"] for m in evals]


def test_tensorboard_reader_if_installed(out):
    """TensorBoard's own loader, where it is installed (Debian has no package for it)."""
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                             reason="tensorboard is not installed (not in Debian); the test above reads the files "
                                    "by its format rules")
    folder = os.path.join(out, "runs", os.listdir(os.path.join(out, "runs"))[0])
    acc = ea.EventAccumulator(folder)
    acc.Reload()
    assert "train/loss" in acc.Tags()["scalars"] and "eval/loss" in acc.Tags()["scalars"]


def test_report_to_values(out, tmp_path):
    """"none" writes no event files, a list works, logging_dir is where they
    go, and an integration qtune does not have is refused by name."""
    d = os.path.dirname(out)
    base = json.load(open(os.path.join(d, "job.json")))
    base["train"].update({"max_steps": 2, "eval_steps": 0})
    base["deepspeed"].pop("fp16")
    base["deepspeed"].pop("scheduler")
    for name, report_to, logdir in (("none", "none", None), ("list", ["tensorboard"], "tb"), ("absent", None, None)):
        job = dict(base, output_dir="out-" + name, train=dict(base["train"]))
        if report_to is None:
            job["train"].pop("report_to")
        else:
            job["train"]["report_to"] = report_to
        if logdir:
            job["train"]["logging_dir"] = logdir
        path = os.path.join(d, "job-%s.json" % name)
        json.dump(job, open(path, "w"))
        run("train", path)
        o = os.path.join(d, "out-" + name)
        assert os.path.exists(os.path.join(o, "report.html"))
        assert not os.path.exists(os.path.join(o, "runs"))
        if logdir:
            ev = os.listdir(os.path.join(d, logdir))
            assert len(ev) == 1 and len(scalars(read_events(os.path.join(d, logdir, ev[0])))["train/loss"]) == 2
    job = dict(base, output_dir="out-wandb", train=dict(base["train"], report_to=["tensorboard", "wandb"]))
    path = os.path.join(d, "job-wandb.json")
    json.dump(job, open(path, "w"))
    p = run("train", path, check=False)
    assert p.returncode != 0
    assert "train.report_to names wandb" in p.stderr and '"tensorboard"' in p.stderr, p.stderr
    assert not os.path.exists(os.path.join(d, "out-wandb"))


def test_resume_keeps_the_report_whole(out):
    """A resumed run's page holds the lines from before the resume, and the
    TensorBoard files of both starts hold each step once; overwrite removes
    both with the rest of the run's outputs."""
    d = os.path.dirname(out)
    job = json.load(open(os.path.join(d, "job.json")))
    job["train"].update({"max_steps": 2, "save_steps": 2, "eval_steps": 0})
    job["deepspeed"].pop("fp16")
    job["deepspeed"].pop("scheduler")
    job["output_dir"] = "out-resume"
    path = os.path.join(d, "job-resume.json")
    json.dump(job, open(path, "w"))
    run("train", path)
    run("train", path, "--set", "train.max_steps=4")
    o = os.path.join(d, "out-resume")
    _, data = embedded(os.path.join(o, "report.html"))
    assert data["rows"] == metrics(o) and data["status"] == "finished" and data["max_steps"] == 4
    assert [r["step"] for r in data["rows"] if "loss" in r] == [1, 2, 3, 4]
    steps = []
    for folder in os.listdir(os.path.join(o, "runs")):
        for f in os.listdir(os.path.join(o, "runs", folder)):
            steps += [s for s, _ in scalars(read_events(os.path.join(o, "runs", folder, f)))["train/loss"]]
    assert sorted(steps) == [1, 2, 3, 4]
    run("train", path, "--set", "train.overwrite_output_dir=true", "--set", "train.report_to=none")
    assert not os.path.exists(os.path.join(o, "runs"))
    assert [r["step"] for r in embedded(os.path.join(o, "report.html"))[1]["rows"] if "loss" in r] == [1, 2]


def test_stopped_run_says_so(out):
    """`qtune stop` ends a run: the page's last word is "stopped" (it stops
    reloading), and the run's own message is the one printed."""
    import time
    d = os.path.dirname(out)
    job = json.load(open(os.path.join(d, "job.json")))
    job["train"].update({"max_steps": 100000, "eval_steps": 0})
    job["deepspeed"].pop("fp16")
    job["deepspeed"].pop("scheduler")
    job["output_dir"] = "out-stop"
    path = os.path.join(d, "job-stop.json")
    json.dump(job, open(path, "w"))
    o = os.path.join(d, "out-stop")
    from trainutil import QTUNE, env
    p = subprocess.Popen([QTUNE, "train", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    try:
        for _ in range(600):
            if os.path.exists(os.path.join(o, "metrics.jsonl")) and len(metrics(o)) >= 3:
                break
            time.sleep(0.1)
        assert embedded(os.path.join(o, "report.html"))[1]["status"] == "running"
        run("stop", o)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0 and "stopped at step" in err, err
    _, data = embedded(os.path.join(o, "report.html"))
    assert data["status"] == "stopped" and data["rows"] == metrics(o)
