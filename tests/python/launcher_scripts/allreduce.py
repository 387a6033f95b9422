"""smp.init() then a torch.distributed allreduce over the world: rank r sends r."""
import torch
import torch.distributed as dist

import smp

smp.init()
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank)])
dist.all_reduce(t)
assert t.item() == world * (world - 1) / 2, (t.item(), world)
print(f"ALLREDUCE rank={rank} world={world} sum={t.item():g}")
