"""qtune generate ends with one line on stderr giving the prompt and decode
speeds (prompt tokens through the batched forward, one-token decode steps),
counted exactly; QTUNE_LOG=quiet silences it; stdout stays the output."""
import json
import re

from conftest import qtune

LINE = re.compile(r"^qtune: prompt (\d+) tokens, ([0-9.]+) tok/s; decode (\d+) tokens, ([0-9.]+) tok/s$")


def test_speed_line(tmp_path):
    m = tmp_path / "m"
    qtune("init", "--out", m, "--preset", "tiny", "--seed", "3", check=0)
    p = qtune("generate", "--model", m, "--prompt-ids", "1,2,3", "--max-new", "6", "--temperature", "0",
              "--json", check=0)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    err = p.stderr.strip().splitlines()
    assert len(err) == 1, p.stderr
    g = LINE.match(err[0])
    assert g, err[0]
    assert int(g.group(1)) == 3
    # each sampled token is fed back as one decode step, except the one that reaches --max-new
    n = len(out["ids"])
    assert int(g.group(3)) == (n if out["stop"] == "eos" else n - 1)
    assert float(g.group(2)) > 0 and (float(g.group(4)) > 0 or len(out["ids"]) <= 1)
    p = qtune("generate", "--model", m, "--prompt-ids", "1,2,3", "--max-new", "6", "--temperature", "0",
              check=0, env={"QTUNE_LOG": "quiet"})
    assert p.stderr == ""
