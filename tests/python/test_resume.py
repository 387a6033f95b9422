"""A Hugging Face Trainer-style resume (its SMP >= 1.10 code path) continues exactly:
3 AdamW steps after the resume equal the uninterrupted run bitwise. The Trainer loads
the optimizer state in a post-step hook, which must run once (SMP v1), not after
every step."""

SCRIPT = r"""
import os, sys, torch, torch.nn as nn
from pathlib import Path
import smdistributed.modelparallel.torch as smp

phase, out = sys.argv[1], sys.argv[2]
smp.init({"partitions": 2, "microbatches": 2, "ddp": True, "timeout_s": 60})
OPTIMIZER_NAME, WEIGHTS_NAME = "optimizer.pt", "pytorch_model.bin"

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                    nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3))
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2))

@smp.step
def train(x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    model.backward(loss)
    return loss

def batch(step):
    g = torch.Generator().manual_seed(100 * step + smp.rdp_rank())
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)

def save(output_dir):  # transformers' Trainer._save_checkpoint with smp >= 1.10
    os.makedirs(output_dir, exist_ok=True)
    state_dict = model.state_dict()
    if smp.rdp_rank() == 0 and smp.pp_rank() == 0:
        torch.save(state_dict, os.path.join(output_dir, WEIGHTS_NAME))
    Path(os.path.join(output_dir, "user_content.pt")).touch()
    opt_state_dict = opt.local_state_dict(gather_if_shard=False)
    smp.barrier()
    if smp.rdp_rank() == 0 or smp.state.cfg.shard_optimizer_state:
        smp.save(opt_state_dict, os.path.join(output_dir, OPTIMIZER_NAME), partial=True,
                 v3=smp.state.cfg.shard_optimizer_state)
    smp.barrier()

hook_calls = []
start = 0
if phase == "resume":  # transformers' Trainer._load_from_checkpoint / _load_optimizer...
    checkpoint = os.path.join(out, "checkpoint-2")
    smp.resume_from_checkpoint(path=checkpoint, tag=WEIGHTS_NAME, partial=False,
                               load_optimizer=False)
    def opt_load_hook(mod, opt):
        hook_calls.append(1)
        opt.load_state_dict(smp.load(os.path.join(checkpoint, OPTIMIZER_NAME), partial=True))
    model.register_post_step_hook(opt_load_hook)
    start = 2

for step in range(start, 5):
    train(*batch(step))
    opt.step()
    opt.zero_grad()
    if phase == "full" and step == 1:
        save(os.path.join(out, "checkpoint-2"))

final = model.state_dict()
if smp.rank() == 0:
    torch.save(final, os.path.join(out, f"final_{phase}.pt"))
steps = {k: v.get("step") for k, v in opt.state_dict()["state"].items()}
print("HOOK_CALLS", len(hook_calls), "ADAM_STEPS", sorted(set(int(s) for s in steps.values())))
"""


def test_hugging_face_style_resume_equals_the_uninterrupted_run_bitwise(ranks, tmp_path):
    import torch
    out = str(tmp_path)
    full = ranks(SCRIPT, 4, args=("full", out))
    resumed = ranks(SCRIPT, 4, args=("resume", out))
    for r in full:
        assert "HOOK_CALLS 0 ADAM_STEPS [5]" in r.stdout, r
    for r in resumed:
        # The hook ran once, after the first step: AdamW counts 2 + 3 steps, not 2 + 1.
        assert "HOOK_CALLS 1 ADAM_STEPS [5]" in r.stdout, r
    a = torch.load(tmp_path / "final_full.pt")
    b = torch.load(tmp_path / "final_resume.pt")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
