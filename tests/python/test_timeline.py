"""SMP_TIMELINE (python/smp/timeline): the per-rank bounds, the merge tool.

- With a tiny SMP_TIMELINE_MAX_MB and many steps of a real 2-rank pp=2 job, each
  rank's file stays within the bound, is valid JSON as it is (closed array), ends with
  the stop marker, and the job runs on to its last step.
- SMP_TIMELINE_STEPS=a:b records exactly the steps a .. b-1 (the driver's microbatch
  spans count (b - a) x microbatches) and closes the file after them; each of those
  steps, planned, leaves a "plan" event with the rank's planned and executed actions;
  the first step, which has no plan, records what it ran: the actions of step 2's plan.
- A bad SMP_TIMELINE_MAX_MB or SMP_TIMELINE_STEPS is a ConfigError naming the variable
  and the value.
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
        assert events[-1]["name"] == "smp timeline stopped", events[-3:]
        assert "SMP_TIMELINE_MAX_MB" in events[-1]["args"]["reason"]
        assert sum(e["ph"] == "X" for e in events) > 10, events
    # The merge tool reads the bounded files; no warning, no other output on stderr.
    out = tmp_path / "merged.json"
    proc = subprocess.run([PYTHON, "-m", "smp.timeline", str(out), *files], capture_output=True,
                          text=True, env=rank_env(0, 1, free_port()), timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    merged = json.loads(out.read_text())
    assert {e["pid"] for e in merged} == {0, 1}


def test_step_window_records_those_steps_only(ranks, tmp_path):
    base = tmp_path / "tl"
    res = ranks(SCRIPT, 2, args=("6",), timeout=180,
                env={"SMP_TIMELINE": str(base), "SMP_TIMELINE_STEPS": "2:4"})
    assert all("DONE" in r.stdout for r in res), res
    for r in range(2):
        events = json.loads((tmp_path / f"tl.rank{r}.json").read_text())
        assert events[-1]["name"] == "smp timeline stopped", events[-3:]
        assert "SMP_TIMELINE_STEPS: steps 2..3" in events[-1]["args"]["reason"]
        assert sum(e["ph"] == "X" for e in events) > 0, events
    driver = json.loads((tmp_path / "tl.rank0.json").read_text())
    assert sum(e["name"] == "microbatch" for e in driver) == 2 * 2, driver  # 2 steps x 2 mb
    # Each recorded step ran its plan; the trace holds the list each rank walked, as
    # the plan's log prints it, and what it ran (the same).
    for r in range(2):
        events = json.loads((tmp_path / f"tl.rank{r}.json").read_text())
        plans = [e["args"] for e in events if e["name"] == "plan"]
        assert len(plans) == 2, events
        for p in plans:
            assert p["planned"] and p["executed"] == p["planned"], p
            assert all(a[0] in "FBIW" for a in p["planned"]), p


def test_first_step_records_what_it_ran_without_a_plan(ranks, tmp_path):
    # Note [Order without a list] (smp_core/plan.cpp): step 1 has no plan (its calls are
    # not known until made); its "plan" event has no planned actions and records what
    # each rank ran, in the plan's vocabulary: the same actions, hops aside, as the
    # list step 2 then executes.
    res = ranks(SCRIPT, 2, args=("3",), timeout=180,
                env={"SMP_TIMELINE": str(tmp_path / "tl"), "SMP_TIMELINE_STEPS": "0:2"})
    assert all("DONE" in r.stdout for r in res), res
    for r in range(2):
        events = json.loads((tmp_path / f"tl.rank{r}.json").read_text())
        first, second = [e["args"] for e in events if e["name"] == "plan"]
        assert first["planned"] == [] and first["executed"], first
        assert second["planned"] and second["executed"] == second["planned"], second
        without_hops = sorted(a.split(".")[0] for a in second["planned"])
        assert sorted(first["executed"]) == without_hops, (first, second)


def test_bad_bounds_are_config_errors(tmp_path):
    # One process through every case (smp.init, then smp.shutdown), not one each: ~3 s
    # of interpreter and torch start per case.
    cases = [("SMP_TIMELINE_MAX_MB", v, "is not a number > 0") for v in ("lots", "0", "-3")]
    cases += [("SMP_TIMELINE_STEPS", v, "is not a step window 'a:b'") for v in ("5", "3:1", "x:2")]
    script = tmp_path / "bad.py"
    script.write_text("import json, os, sys, smp\n"
                      "for var, value in json.loads(sys.argv[1]):\n"
                      "    os.environ[var] = value\n"
                      "    try:\n        smp.init({})\n"
                      "    except smp.ConfigError as e:\n        print('CONFIG_ERROR', e)\n"
                      "    smp.shutdown()\n"
                      "    del os.environ[var]\n")
    env = rank_env(0, 1, free_port(), {"SMP_TIMELINE": str(tmp_path / "tl")})
    out = subprocess.run([PYTHON, str(script), json.dumps([c[:2] for c in cases])],
                         capture_output=True, text=True, env=env, timeout=120)
    said = [ln for ln in out.stdout.splitlines() if ln.startswith("CONFIG_ERROR")]
    assert len(said) == len(cases), (out.stdout, out.stderr)
    for (var, value, words), line in zip(cases, said):
        assert line.startswith(f"CONFIG_ERROR smp: environment {var}='{value}' {words}"), line


def test_module_entry_point_usage_without_warning():
    proc = subprocess.run([PYTHON, "-m", "smp.timeline"], capture_output=True, text=True,
                          env=rank_env(0, 1, free_port()), timeout=120)
    assert proc.returncode != 0 and "RuntimeWarning" not in proc.stderr, proc.stderr
    assert proc.stderr.strip() == "usage: python3 -m smp.timeline OUT.json RANK_FILE...", \
        proc.stderr
