"""The per-thread task context of the pipeline: which microbatch the calling thread
works on, whether it runs backward work, and whether it leads serving (Note [Serving]
in smp/pipeline.py). Its own module so that core, step and pipeline can all read it
without importing each other."""
import threading

__all__ = []


class _Task(threading.local):
    mb = None
    backward = False
    leader = False  # the serving thread that takes new requests


current = _Task()
