"""An SMP v1 training script, unchanged but for running on CPU with synthetic data.

It is written against `smdistributed.modelparallel.torch` exactly as SageMaker's model
parallelism v1 examples are (config from SM_HP_MP_PARAMETERS, optimizer built before
wrapping, LR scheduler, smp.amp.GradScaler, model and scaler passed into @smp.step,
per-microbatch Python floats from the evaluation step):

    SM_HP_MP_PARAMETERS='{"partitions": 2, "microbatches": 2, "ddp": true}' \
        build/bin/smprun --nproc_per_node 4 examples/smp_v1_mnist.py
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR

import smdistributed.modelparallel.torch as smp


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, 1)
        self.conv2 = nn.Conv2d(16, 32, 3, 1)
        self.dropout1 = nn.Dropout2d(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32 * 6 * 6, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_digits(n, seed):
    """Ten fixed 16x16 prototypes plus noise: a learnable stand-in for MNIST."""
    g = torch.Generator().manual_seed(1)
    protos = torch.rand(10, 1, 16, 16, generator=g)
    g.manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = protos[labels] + 0.3 * torch.randn(n, 1, 16, 16, generator=g)
    return images, labels


@smp.step
def train_step(model, scaler, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="mean")
    model.backward(scaler.scale(loss))
    return output, loss


@smp.step
def test_step(model, data, target):
    output = model(data)
    loss = F.nll_loss(output, target, reduction="sum").item()
    pred = output.argmax(dim=1, keepdim=True)
    correct = pred.eq(target.view_as(pred)).sum().item()
    return loss, correct


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1.0)
    args = parser.parse_args()

    smp.init()
    torch.manual_seed(42)
    model = Net()
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)  # before wrapping, as v1
    model = smp.DistributedModel(model)
    scaler = smp.amp.GradScaler()
    optimizer = smp.DistributedOptimizer(optimizer)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)

    # Each dp replica reads its own shard of the data.
    train_x, train_y = synthetic_digits(1024, seed=100 + smp.dp_rank())
    test_x, test_y = synthetic_digits(256, seed=7)
    for epoch in range(1, args.epochs + 1):
        model.train()
        for i in range(0, len(train_x), args.batch_size):
            optimizer.zero_grad()
            _, loss_mb = train_step(model, scaler, train_x[i:i + args.batch_size],
                                    train_y[i:i + args.batch_size])
            loss = loss_mb.reduce_mean()
            scaler.step(optimizer)
            scaler.update()
        scheduler.step()
        model.eval()
        test_loss, correct = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(test_x), args.batch_size):
                loss_batch, correct_batch = test_step(model, test_x[i:i + args.batch_size],
                                                      test_y[i:i + args.batch_size])
                test_loss += sum(loss_batch)
                correct += sum(correct_batch)
        if smp.rank() == 0:
            print(f"epoch {epoch}: train loss {loss.item():.3f}, test loss "
                  f"{test_loss / len(test_x):.3f}, accuracy {correct}/{len(test_x)} "
                  f"(lr {scheduler.get_last_lr()[0]:.3f}, local params "
                  f"{sum(p.numel() for p in model.local_parameters())})", flush=True)


if __name__ == "__main__":
    main()
