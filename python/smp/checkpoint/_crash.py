"""Fault injection for tests: SMP_CHECKPOINT_CRASH_AT="<stage>:<pp rank>" SIGKILLs that
rank at that moment of a partial save (tests/python/test_checkpoint.py). The stages,
in order: after_write, after_seal, before_rename, after_rename (smp/checkpoint/_commit.py)."""
import os
import signal

from smp.checkpoint._common import topology

__all__ = []


def crash_point(stage):
    want = os.environ.get("SMP_CHECKPOINT_CRASH_AT")
    if want and want == f"{stage}:{topology()[0]}":
        os.kill(os.getpid(), signal.SIGKILL)
