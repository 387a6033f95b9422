"""SMP_TIMELINE (python/smp/timeline): the per-rank size bound, the merge tool.

- With a tiny SMP_TIMELINE_MAX_MB and many steps of a real 2-rank pp=2 job, each
  rank's file stays within the bound, is valid JSON as it is (closed array), ends with
  the truncation marker, and the job runs on to its last step.
- A bad SMP_TIMELINE_MAX_MB is a ConfigError naming the variable and the value.
- `python3 -m smp.timeline` merges the ranks' files with nothing on stderr (no runpy
  RuntimeWarning: smp.timeline is a package run through its __main__).
"""
import json
import subprocess

from conftest import PYTHON, free_port, rank_env

STEPS = 40
MAX_MB = 0.01

SCRIPT = r"""
import sys
import torch, torch.nn as nn
import smp
smp.init({"partitions": 2, "microbatches": 2, "timeout_s": 60})
torch.manual_seed(0)
model = smp.DistributedModel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8),
                                           nn.Tanh(), nn.Linear(8, 2)))

@smp.step
def step(x):
    out = model(x)
    model.backward(out.sum())
    return out

for i in range(int(sys.argv[1])):
    step(torch.randn(4, 4))
print("DONE", flush=True)
"""


def test_size_bound_holds_and_file_stays_valid(ranks, tmp_path):
    base = tmp_path / "tl"
    res = ranks(SCRIPT, 2, args=(str(STEPS),), timeout=180,
                env={"SMP_TIMELINE": str(base), "SMP_TIMELINE_MAX_MB": str(MAX_MB)})
    assert all("DONE" in r.stdout for r in res), res
    bound = int(MAX_MB * (1 << 20))
    files = []
    for r in range(2):
        path = tmp_path / f"tl.rank{r}.json"
        files.append(str(path))
        text = path.read_text()
        assert len(text.encode()) <= bound, (r, len(text.encode()), bound)
        events = json.loads(text)  # valid as written: the array was closed
        assert events[-1]["name"] == "smp timeline truncated", events[-3:]
        assert "SMP_TIMELINE_MAX_MB" in events[-1]["args"]["reason"]
        assert sum(e["ph"] == "X" for e in events) > 10, events
    # The merge tool reads the bounded files; no warning, no other output on stderr.
    out = tmp_path / "merged.json"
    proc = subprocess.run([PYTHON, "-m", "smp.timeline", str(out), *files], capture_output=True,
                          text=True, env=rank_env(0, 1, free_port()), timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    merged = json.loads(out.read_text())
    assert {e["pid"] for e in merged} == {0, 1}


def test_bad_max_mb_is_a_config_error(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("import smp\n"
                      "try:\n    smp.init({})\n"
                      "except smp.ConfigError as e:\n    print('CONFIG_ERROR', e)\n")
    for value in ("lots", "0", "-3"):
        env = rank_env(0, 1, free_port(), {"SMP_TIMELINE": str(tmp_path / "tl"),
                                           "SMP_TIMELINE_MAX_MB": value})
        out = subprocess.run([PYTHON, str(script)], capture_output=True, text=True, env=env,
                             timeout=120)
        assert (f"CONFIG_ERROR smp: environment SMP_TIMELINE_MAX_MB='{value}' is not a number "
                "> 0") in out.stdout, (value, out.stdout, out.stderr)


def test_module_entry_point_usage_without_warning():
    proc = subprocess.run([PYTHON, "-m", "smp.timeline"], capture_output=True, text=True,
                          env=rank_env(0, 1, free_port()), timeout=120)
    assert proc.returncode != 0 and "RuntimeWarning" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == "usage: python3 -m smp.timeline OUT.json RANK_FILE...", \
        proc.stderr
