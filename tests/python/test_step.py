"""@smp.step: microbatch splitting, StepOutput and return containers (one process)."""

SCRIPT = r"""
import sys, collections, torch, torch.nn as nn
import smp

smp.init({"microbatches": 4})
model = smp.DistributedModel(nn.Linear(3, 2))
seen = []

@smp.step
def bare(x, y, scale, tup, dct, meta):
    seen.append((x.shape, y.shape, scale, [t.shape for t in tup], dct["a"].shape, meta))
    return x.sum(), {"out": model(x), "n": x.shape[0]}, (y, "tag")

x, y = torch.randn(8, 3), torch.arange(16).view(8, 2)
total, d, (ys, tags) = bare(x, y, 2.0, (torch.ones(8, 1), torch.zeros(8)), {"a": torch.ones(8, 5)},
                            "meta")
assert [s[0] for s in seen] == [torch.Size([2, 3])] * 4
assert all(s[2] == 2.0 and s[5] == "meta" for s in seen)
assert seen[0][3] == [torch.Size([2, 1]), torch.Size([2])] and seen[0][4] == torch.Size([2, 5])
assert isinstance(total, smp.StepOutput) and len(total.outputs) == 4
torch.testing.assert_close(total.reduce_sum(), x.sum())
torch.testing.assert_close(total.reduce_mean(), x.sum() / 4)
assert total.stack().shape == (4,) and total.concat().shape == (4,)
assert d["out"].concat().shape == (8, 2) and d["n"] == [2, 2, 2, 2]
assert d["out"].outputs[0].requires_grad is False           # detach_outputs=True
assert torch.equal(ys.concat(), y) and tags == ["tag"] * 4

# Called form: non_split_inputs and input_split_axes; objects with smp_slice.
class Shards:
    def __init__(self, items): self.items = items
    def smp_slice(self, num_mb, mb, axis):
        k = len(self.items) // num_mb
        return Shards(self.items[mb * k:(mb + 1) * k])

@smp.step(non_split_inputs=["w"], input_split_axes={"z": 1}, detach_outputs=False)
def called(z, w, s):
    assert w.shape == (8, 3) and z.shape == (3, 2) and len(s.items) == 2
    return model(z.t())

out = called(torch.randn(3, 8), torch.randn(8, 3), Shards(list(range(8))))
assert out.outputs[0].requires_grad and out.concat().shape == (8, 2)

# Errors name the input, the size and the allowed values.
def expect_error(fn, *args, needle, kind=ValueError, **kw):
    try:
        fn(*args, **kw)
    except kind as e:
        assert needle in str(e), e
        return
    raise SystemExit(f"no error for {needle}")
expect_error(bare, torch.randn(6, 3), y, 1, (), {"a": torch.ones(8)}, None,
             needle="input 'x' has size 6 along axis 0, not divisible by microbatches=4",
             kind=smp.ConfigError)  # on a later step too, not only the first one's
expect_error(smp.step(non_split_inputs=["nope"])(lambda a: a), torch.ones(4),
             needle="input 'nope' named in non_split_inputs/input_split_axes is not a parameter")
expect_error(smp.step(input_split_axes={"a": 3})(lambda a: a), torch.ones(4, 4),
             needle="split axis 3 is out of range", kind=smp.ConfigError)

# Gradients are averaged over microbatches: 4 microbatches == one whole-batch step.
ref = nn.Linear(3, 2)
ref.load_state_dict(model.state_dict())
@smp.step
def train(x, t):
    loss = nn.functional.mse_loss(model(x), t)
    model.backward(loss)
    return loss
t = torch.randn(8, 2)
train(x, t)
nn.functional.mse_loss(ref(x), t).backward()
for p, q in zip(model.parameters(), ref.parameters()):
    torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)
assert list(model.state_dict()) == ["weight", "bias"]
assert model.local_state_dict()["_smp_is_partial"] is False
print("ok")
"""


def test_step_splitting_and_outputs(ranks):
    res = ranks(SCRIPT, 1)
    assert res[0].stdout.strip().endswith("ok")
