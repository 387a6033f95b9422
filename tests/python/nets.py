"""Small models shared by the rank scripts of several tests (tests/python is on the
ranks' PYTHONPATH, see conftest.rank_env)."""
import torch
import torch.nn as nn

__all__ = ["Net"]


class Net(nn.Module):
    """Four Linear layers (8 -> 32 -> 32 -> 32 -> 4): enough parameters for several
    gradient buckets at a small bucket_cap_mb, and 32x32 matrices PowerSGD compresses."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        return self.head(torch.relu(self.fc3(h)))
