"""Restarts that resume by themselves (Note [Automatic resume] in smp/auto_resume.py):
a pp=2 x dp=2 job under `smprun --max_restarts 1 --checkpoint_dir`, one of whose ranks is
SIGKILLed at a random step, ends with the weights of the run that was never killed, bit
for bit. The script has no resume code: it saves checkpoints and runs its loop from 0.
Its model has dropout, and its data augmentation draws from the global generator
outside the step, so the random states must come back exactly where they were saved."""
import json
import os
import random
import subprocess
import time

import pytest
import torch

from conftest import PYTHON, assert_all_ok, run_ranks
from test_launcher import BUILD, SMPRUN, clean_env

pytestmark = pytest.mark.skipif(not SMPRUN.exists(), reason=f"{SMPRUN} not built")

SCRIPT = r"""
import json, os, signal, sys, time
import torch, torch.nn as nn
import smp

out, plan = sys.argv[1], json.loads(sys.argv[2])
attempt = int(os.environ["SMP_RESTART_COUNT"])
smp.init({"partitions": 2, "microbatches": 2, "ddp": True, "timeout_s": 60})
ckpt = os.environ["SMP_CHECKPOINT_DIR"]

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.GELU(), nn.Linear(32, 32),
                    nn.Dropout(0.2), nn.GELU(), nn.Linear(32, 4))
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2))
if plan.get("hook") == "powersgd":  # its error feedback is each dp rank's own state
    from smp.ddp_comm_hooks import powerSGD_hook as psgd
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                               start_powerSGD_iter=2)
    model.register_comm_hook(state, psgd.powerSGD_hook)

@smp.step
def train(x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    model.backward(loss)
    return loss

def batch(step):  # the data order: seeded per step, as a DistributedSampler's
    g = torch.Generator().manual_seed(1000 * step + smp.rdp_rank())
    x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
    return x + 0.05 * torch.randn_like(x), y  # augmentation: the global generator

first_real = None
for step in range(10):
    if attempt == 0 and step == plan.get("kill_at") and smp.rank() == plan["rank"]:
        with open(os.path.join(os.path.dirname(out), "killed_at"), "w") as fh:
            fh.write(str(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    loss = train(*batch(step))
    opt.step()
    opt.zero_grad()
    value = loss.reduce_mean().item()
    if first_real is None and value == value:  # not NaN: computed, not fast-forwarded
        first_real = (step, time.time())
    if step % 3 == 2:
        if attempt == 0 and step == plan.get("crash_in_save_at"):
            os.environ["SMP_CHECKPOINT_CRASH_AT"] = f"after_write:{plan['pp_rank']}"
        smp.save_checkpoint(ckpt, tag=f"step{step + 1}")
final = model.state_dict()
if smp.rank() == 0:
    torch.save(final, out)
    print("RESUMED", json.dumps({"attempt": attempt, "first_real_step": first_real[0],
                                 "first_real_time": first_real[1]}), flush=True)
"""


def _run(tmp_path, name, plan):
    work = tmp_path / name
    work.mkdir()
    script = work / "train.py"
    script.write_text(SCRIPT)
    env = clean_env(PYTHONPATH=str(BUILD / "python"), SMP_PYTHON=PYTHON)
    p = subprocess.run([str(SMPRUN), "--nproc_per_node", "4", "--max_restarts", "1",
                        "--checkpoint_dir", str(work / "ckpt"), str(script),
                        str(work / "final.pt"), json.dumps(plan)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    info = json.loads(p.stdout.split("RESUMED ", 1)[1].splitlines()[0].split("] ")[-1])
    return torch.load(work / "final.pt"), info, p, work


def _assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


_REFERENCES = {}


def reference(tmp_path_factory, hook=None):
    """The uninterrupted run (saving its checkpoints too), once per hook.

    It runs the same script on 4 real ranks with the environment smprun gives a first
    attempt (SMP_RESTART_COUNT=0, SMP_CHECKPOINT_DIR), through conftest's pre-imported
    rank processes: what is compared is the run that was never killed, and a cold start
    under smprun (4 torch imports on 2 cores, some 5 s) adds nothing to it."""
    if hook not in _REFERENCES:
        work = tmp_path_factory.mktemp("ref")
        (work / "ckpt").mkdir()
        res = run_ranks(SCRIPT, 4, work, timeout=300,
                        env={"SMP_RESTART_COUNT": "0", "SMP_CHECKPOINT_DIR": str(work / "ckpt")},
                        args=(str(work / "final.pt"), json.dumps({"hook": hook})))
        assert_all_ok(res)
        info = json.loads(res[0].stdout.split("RESUMED ", 1)[1].splitlines()[0])
        assert info["attempt"] == 0 and info["first_real_step"] == 0
        _REFERENCES[hook] = torch.load(work / "final.pt")
    return _REFERENCES[hook]


# With PowerSGD only: its error feedback is state the resume must bring back too, and a
# resume without a hook is the interrupted-save test's below (kept to the suite's budget).
@pytest.mark.parametrize("hook", ["powersgd"])
def test_killed_rank_restarts_and_ends_bitwise_equal_to_the_uninterrupted_run(
        tmp_path_factory, tmp_path, hook):
    rng = random.Random()
    plan = {"kill_at": rng.randint(3, 9), "rank": rng.randint(0, 3), "hook": hook}
    final, info, p, work = _run(tmp_path, "killed", plan)
    assert info["attempt"] == 1, (plan, p.stderr[-3000:])
    # The newest checkpoint before the kill: saved after step 2, 5 or 8 (tags step3..9).
    resumed_from = max(s for s in (3, 6, 9) if s <= plan["kill_at"])
    assert info["first_real_step"] == resumed_from, (plan, info)
    _assert_bitwise_equal(final, reference(tmp_path_factory, hook))
    restart_s = info["first_real_time"] - float((work / "killed_at").read_text())
    print(f"plan {plan}: resumed at step {resumed_from}; kill to first resumed step "
          f"{restart_s:.2f} s")


def test_a_save_the_kill_interrupted_leaves_the_previous_checkpoint_in_use(tmp_path_factory,
                                                                           tmp_path):
    # pp rank 1 dies in the middle of the second save (step6): its parts are written,
    # `newest` still names step3.
    plan = {"crash_in_save_at": 5, "pp_rank": 1}
    final, info, p, work = _run(tmp_path, "crash_in_save", plan)
    assert info["attempt"] == 1 and info["first_real_step"] == 3, (info, p.stderr[-3000:])
    _assert_bitwise_equal(final, reference(tmp_path_factory))
    assert (work / "ckpt" / "newest").read_text() == "step9"
