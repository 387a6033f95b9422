"""smp demo: a character-level transformer on Shakespeare's sonnets, split into
pipeline stages (partitions) and replicated for data parallelism (ddp).

    build/bin/smprun --nproc_per_node 4 \
        --config '{"partitions": 2, "microbatches": 4, "ddp": true}' examples/demo.py

Each of the 2 replicas trains on its own shard of every batch; each replica's model is
split over 2 ranks. Rank 0 prints the loss; with SMP_TIMELINE set, every rank writes a
Chrome/Perfetto trace of its steps.
"""
import argparse
import math
import os
import time

import torch
import torch.nn as nn

import smp

HERE = os.path.dirname(os.path.abspath(__file__))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        t = x.size(1)
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    def __init__(self, vocab, d=64, heads=4, layers=4, context=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        pos = torch.arange(idx.size(1))
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16, help="sequences per replica")
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()

    smp.init()
    torch.manual_seed(0)
    text = open(os.path.join(HERE, "data", "sonnets.txt")).read()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)

    model = smp.DistributedModel(CharTransformer(len(chars), context=args.context))
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))

    @smp.step
    def train_step(x, y):
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        model.backward(loss)
        return loss

    # Every replica draws a different shard; the ranks of one replica the same one.
    gen = torch.Generator().manual_seed(1234 + smp.dp_rank())
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ix = torch.randint(0, len(data) - args.context - 1, (args.batch,), generator=gen)
        x = torch.stack([data[i:i + args.context] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + args.context] for i in ix])
        loss = train_step(x, y).reduce_mean()
        optimizer.step()
        optimizer.zero_grad()
        if smp.rank() == 0 and (step == 1 or step % 5 == 0):
            print(f"step {step:3d}  loss {loss.item():.3f}  (uniform guess "
                  f"{math.log(len(chars)):.3f})", flush=True)
    if smp.rank() == 0:
        print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f} s on "
              f"{smp.size()} ranks (pp={smp.pp_size()} x dp={smp.dp_size()})")
        if os.environ.get("SMP_TIMELINE"):
            print(f"timeline: {os.environ['SMP_TIMELINE']}.rank<N>.json "
                  "(merge: python3 -m smp.timeline out.json "
                  f"{os.environ['SMP_TIMELINE']}.rank*.json; open in ui.perfetto.dev)")


if __name__ == "__main__":
    main()
