"""A GPT-style model (tied embedding/head, Dropout, LayerNorm) trained the way an SMP v1
user would, through smprun: global gradient clipping, evaluation in eval mode, a
partial checkpoint every few steps and a resume that continues exactly, then a check
against the plain module trained in one process on the same data.

    build/bin/smprun --nproc_per_node 4 \\
        --config '{"partitions": 2, "microbatches": 4, "ddp": true}' \\
        examples/gpt_checkpoint.py --dir /tmp/gpt_ckpt

`--activation-checkpointing` checkpoints every transformer layer (SMP v1.6's
smp.set_activation_checkpointing): the same numbers, less activation memory.
`--delay-init` builds the model inside smp.delay_param_initialization: each rank
allocates and initializes only its partition, with the values of the eager build (the
plain reference below is built eagerly from the same seed).
"""
import argparse
import copy
import math
import os

import torch
import torch.nn as nn

import smdistributed.modelparallel.torch as smp  # SMP v1's import line works unchanged

VOCAB, CTX, D, LAYERS = 64, 16, 32, 4


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        h = self.ln1(x)
        x = x + self.drop(self.attn(h, h, h, attn_mask=mask, need_weights=False)[0])
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D), nn.Embedding(CTX, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def batches(step, batch):
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, VOCAB, (batch, CTX + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/gpt_ckpt")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--delay-init", action="store_true")
    args = ap.parse_args()
    smp.init()
    torch.manual_seed(0)
    if args.delay_init:
        plain = GPT()  # the reference, eager, trained in this process alone
        torch.manual_seed(0)
        with smp.delay_param_initialization():
            net = GPT()  # no parameter memory until the first step partitions it
    else:
        net = GPT()
        plain = copy.deepcopy(net)  # the reference, trained in this process alone
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=3e-3))
    if args.activation_checkpointing:
        for block in model.get_module().blocks:
            smp.set_activation_checkpointing(block)

    @smp.step
    def train_step(x, y):
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        model.backward(loss)
        return loss

    @smp.step
    def eval_step(x, y):
        return nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())

    per_replica, dp = 8, smp.dp_size()
    lo = smp.dp_rank() * per_replica

    def train(step):
        x, y = batches(step, per_replica * dp)
        loss = train_step(x[lo:lo + per_replica], y[lo:lo + per_replica]).reduce_mean()
        norm = model.clip_grad_norm_(1.0)  # over every partition, the same on every rank
        opt.step()
        opt.zero_grad()
        return loss.item(), norm.item()

    # Dropout makes training differ from the plain run; evaluation (eval mode) must not.
    for step in range(args.steps):
        loss, norm = train(step)
        if smp.rank() == 0:
            print(f"step {step} loss {loss:.4f} grad norm {norm:.3f}")
        if step == args.steps // 2:
            smp.save_checkpoint(args.dir, tag=f"step{step}", partial=True, model=model,
                                optimizer=opt)
    model.eval()
    x, y = batches(99, 8)
    with torch.no_grad():
        a = eval_step(x, y).reduce_mean()
        b = eval_step(x, y).reduce_mean()
    assert torch.equal(a, b), (a, b)  # eval mode reaches every partition: deterministic
    full = model.state_dict()  # the plain module's keys, both names of the tied weight
    plain.load_state_dict(full)
    plain.eval()
    with torch.no_grad():
        want = nn.functional.cross_entropy(plain(x).flatten(0, 1), y.flatten())
    assert math.isclose(a.item(), want.item(), rel_tol=1e-5), (a.item(), want.item())
    if smp.rank() == 0:
        print(f"eval loss {a.item():.5f} == plain module in one process {want.item():.5f}")
        print("checkpoint", sorted(os.listdir(args.dir)))


if __name__ == "__main__":
    main()
