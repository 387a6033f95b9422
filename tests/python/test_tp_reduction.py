"""Data-parallel reduction of tensor-parallel slices (issue 41; Note [Slices reduce over
their rdp group] in smp_core/detail/reducer_build.cpp, Note [Norm over tp slices] in
smp/grad_norm.py): a Linear sliced by hand (column split, as docs/tensor_parallel.md's
contract marks it) followed by a replicated Linear trains at tp=2 x rdp=2 as the full
model in one process, and clip_grad_norm_ returns the one-process norm.
"""
from tp_reference import case_outputs, one_job

SLICED = r"""
import copy, json, sys
import torch, torch.nn as nn, torch.distributed as dist
import smp

prescaled = sys.argv[1] == "1"
smp.init({"ddp": True, "tensor_parallel_degree": 2, "prescaled_batch": prescaled,
          "timeout_s": 60, "shard_optimizer_state": sys.argv[2:] == ["shard"]})
tp, T, tpg = smp.tp_rank(), smp.tp_size(), smp.get_tp_process_group()


class GatherRows(torch.autograd.Function):
    # Entering (each tp rank its own batch): the tp group's batches along dim 0;
    # backward: the sum of the gradients, this rank's rows.
    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(T)]
        dist.all_gather(parts, x.contiguous(), group=tpg)
        ctx.n = x.shape[0]
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=tpg)
        return g[tp * ctx.n:(tp + 1) * ctx.n]


class EnterShared(torch.autograd.Function):
    # Entering with prescaled_batch (the tp ranks hold the same batch): identity;
    # backward: the sum of the gradients.
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=tpg)
        return g


class GatherCols(torch.autograd.Function):
    # The output columns of every tp rank; backward: this rank's columns of the summed
    # gradients (of the one gradient with prescaled_batch, where the ranks agree).
    @staticmethod
    def forward(ctx, y):
        parts = [torch.empty_like(y) for _ in range(T)]
        dist.all_gather(parts, y.contiguous(), group=tpg)
        ctx.n = y.shape[1]
        return torch.cat(parts, 1)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        if not prescaled:
            dist.all_reduce(g, group=tpg)
        return g[:, tp * ctx.n:(tp + 1) * ctx.n].contiguous()


class Net(nn.Module):
    def __init__(self, ref):
        super().__init__()
        full = ref[0]
        out = full.out_features // T
        self.col = nn.Linear(full.in_features, out)
        rows = slice(tp * out, (tp + 1) * out)
        with torch.no_grad():
            self.col.weight.copy_(full.weight[rows])
            self.col.bias.copy_(full.bias[rows])
        for p, whole in ((self.col.weight, full.weight), (self.col.bias, full.bias)):
            p._smp_tp_dim = 0
            p._smp_tp_full_shape = tuple(whole.shape)
        self.out = copy.deepcopy(ref[2])  # replicated

    def forward(self, x):
        n = x.shape[0]
        h = EnterShared.apply(x) if prescaled else GatherRows.apply(x)
        h = GatherCols.apply(self.col(h))
        if not prescaled:
            h = h[tp * n:(tp + 1) * n]
        return self.out(torch.tanh(h))


torch.manual_seed(0)
ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
net = Net(ref)
if smp.rdp_rank() == 1:  # the first step's broadcasts must repair this (slices: over rdp)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)


@smp.step
def step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss


batches = smp.rdp_size() if prescaled else smp.dp_size()
mine = smp.rdp_rank() if prescaled else smp.dp_rank()
norms = []
for i in range(3):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(4 * batches, 8, generator=g), torch.randn(4 * batches, 3, generator=g)
    step(x[4 * mine:4 * mine + 4], y[4 * mine:4 * mine + 4])
    norm = model.clip_grad_norm_(0.05)
    opt.step(); opt.zero_grad()
    loss = sum(nn.functional.mse_loss(ref(x[4 * b:4 * b + 4]), y[4 * b:4 * b + 4])
               for b in range(batches)) / batches
    loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step(); ref_opt.zero_grad()
    norms.append([norm.item(), ref_norm.item()])


def whole(p):
    parts = [torch.empty_like(p) for _ in range(T)]
    dist.all_gather(parts, p.detach().contiguous(), group=tpg)
    return torch.cat(parts, 0)


mine_full = {"0.weight": whole(net.col.weight), "0.bias": whole(net.col.bias),
             "2.weight": net.out.weight, "2.bias": net.out.bias}
diff = max((mine_full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
out = {"rank": smp.rank(), "max_diff": diff, "norms": norms,
       "sizes": [smp.tp_size(), smp.rdp_size(), smp.dp_size()],
       "sliced": model.replica.reducer.sliced(),
       "buckets": model.replica.reducer.bucket_indices()}
print("TPR " + json.dumps(out), flush=True)
"""


def _check(reps):
    for r in reps:
        assert r["sizes"] == [2, 2, 4], r
        assert r["sliced"], r
        # Slices and replicated parameters never share a bucket.
        assert all(set(b) <= {0, 1} or set(b).isdisjoint({0, 1}) for b in r["buckets"]), r
        assert r["max_diff"] < 1e-5, r
        for got, want in r["norms"]:
            assert abs(got - want) < 1e-5 * max(1.0, want), r
        assert r["norms"][0][1] > 0.05, r  # the clip clipped


def test_slices_reduce_over_rdp_and_clip_by_the_whole_norm(ranks):
    # One job (tp_reference.one_job): each dp rank's own batch, prescaled_batch, and
    # optimizer-state sharding (Note [Sharded tp slices] in smp/optimizer_sharding.py:
    # each slice stepped by one rank of its rdp group, each gradient counted once in the
    # norm over the world). (The comm hook refused with slices: test_tp_modules.py.)
    res = ranks(one_job([(SLICED, ("0",)), (SLICED, ("1",)), (SLICED, ("0", "shard"))]), 4,
                timeout=240)
    by_case = list(zip(*(case_outputs(r.stdout, "TPR") for r in res)))
    assert len(by_case) == 3, [r.stdout for r in res]
    for reps in by_case:
        _check(sorted(reps, key=lambda o: o["rank"]))
