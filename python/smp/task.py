"""The per-thread task context of the pipeline: which microbatch the calling thread
works on and whether it runs backward work. Its own module so that process_state,
remote_errors and pipeline can all read it without importing each other."""
import threading

__all__ = []


class _Task(threading.local):
    mb = None
    backward = False


current = _Task()
