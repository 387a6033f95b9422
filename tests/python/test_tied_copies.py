"""Copies of a parameter tied across pipeline ranks never drift apart silently
(placement.py, Note [Tied copies]): local clipping with torch's clip_grad_norm_ on some parameters is
named within one step; smp's global clipping (model.clip_grad_norm_, or torch's on all
of the model's parameters) keeps them equal and matches the plain module."""
import pytest

SCRIPT = r"""
import copy, sys, torch, torch.nn as nn
import smp
mode = sys.argv[1]
smp.init({"partitions": 2, "microbatches": 2, "timeout_s": 60})
V, D = 16, 8

class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.body = nn.Sequential(*[nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.tok.weight  # tied: embedding on pp rank 0, head on 1
    def forward(self, idx):
        return self.head(self.body(self.tok(idx)))

torch.manual_seed(0)
net = TinyGPT()
plain = copy.deepcopy(net)
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2))
plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)

def data(step):
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, V, (4, 6), generator=g)
    return idx, torch.randint(0, V, (4, 6), generator=g)

@smp.step
def train(idx, y):
    loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), y.flatten())
    model.backward(loss)
    return loss

@smp.step
def evaluate(idx, y):
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), y.flatten())

try:
    for step in range(3):
        idx, y = data(step)
        train(idx, y)
        if mode == "local":  # each rank's matrices by their own norm
            torch.nn.utils.clip_grad_norm_(
                [p for p in model.local_parameters() if p.dim() > 1], 0.01)
        elif mode == "torch":  # Note [torch's clip on the whole model]: the global norm
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        else:
            model.clip_grad_norm_(0.01)
        opt.step(); opt.zero_grad()
        nn.functional.cross_entropy(plain(idx).flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01)
        plain_opt.step(); plain_opt.zero_grad()
    loss = evaluate(*data(99)).reduce_mean()
    full = model.state_dict()
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=0, atol=1e-6, msg=k)
    print("OK", float(loss))
except smp.TiedCopiesError as e:
    print("ERR", e)
"""

MESSAGE = ("smp: the copies of tied parameter 'tok.weight' on pp ranks [0, 1] differ: "
           "every holder applied the same 1 optimizer steps to it, so the gradient or the "
           "value of one copy was changed outside the optimizer's step since the last "
           "step. One known cause: torch.nn.utils.clip_grad_norm_ on some of the "
           "model's parameters clips each rank's gradients by that rank's own norm; "
           "model.clip_grad_norm_(max_norm) (or smp.clip_grad_norm_(model, max_norm)) "
           "clips by the norm over every partition and keeps tied copies equal "
           "(rank {r})")


def test_local_clipping_of_a_tied_weight_is_named_within_one_step(ranks):
    res = ranks(SCRIPT, 2, args=("local",))
    for r in res:
        assert "ERR " + MESSAGE.format(r=r.rank) + "\n" in r.stdout, r


@pytest.mark.parametrize("mode", ["global", "torch"])
def test_global_clipping_keeps_tied_copies_equal_and_matches_the_plain_module(ranks, mode):
    # "torch": torch.nn.utils.clip_grad_norm_(model.parameters()) is the global clip.
    res = ranks(SCRIPT, 2, args=(mode,))
    losses = set()
    for r in res:
        assert "OK " in r.stdout, r
        losses.add(r.stdout.split("OK ")[1].split()[0])
    assert len(losses) == 1
