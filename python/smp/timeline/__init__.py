"""`SMP_TIMELINE=path`: each rank appends Chrome/Perfetto trace events of its steps to
`path.rank<N>.json` (one JSON array per file, openable in chrome://tracing or
ui.perfetto.dev; merge ranks with `python3 -m smp.timeline out.json path.rank*.json`).

Events are complete events ("ph": "X") with the rank as pid and the microbatch task as
tid, so each rank is a process row and each microbatch a thread row. When the variable
is unset, `span()` is a no-op context manager (no allocation on the hot path).
"""
import contextlib
import json
import os
import threading
import time

__all__ = []


class _Timeline:
    def __init__(self):
        self.path = None
        self.file = None
        self.lock = threading.Lock()
        self.rank = 0
        self.t0 = 0.0  # CLOCK_MONOTONIC is shared by the processes of a machine

    def start(self, rank):
        base = os.environ.get("SMP_TIMELINE")
        if not base:
            return
        self.rank = rank
        self.path = f"{base}.rank{rank}.json"
        self.file = open(self.path, "w")
        self.file.write("[\n")
        self.file.write(json.dumps({"name": "process_name", "ph": "M", "pid": rank,
                                    "args": {"name": f"rank {rank}"}}))

    @property
    def enabled(self):
        return self.file is not None

    def event(self, name, start, end, mb=None, **args):
        tid = f"mb {mb}" if mb is not None else threading.current_thread().name
        ev = {"name": name, "ph": "X", "pid": self.rank, "tid": tid,
              "ts": (start - self.t0) * 1e6, "dur": (end - start) * 1e6}
        if args:
            ev["args"] = args
        with self.lock:
            self.file.write(",\n" + json.dumps(ev))

    @contextlib.contextmanager
    def _span(self, name, mb, args):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.event(name, start, time.perf_counter(), mb, **args)

    def span(self, name, mb=None, **args):
        if self.file is None:
            return contextlib.nullcontext()
        return self._span(name, mb, args)

    def close(self):
        if self.file is not None:
            with self.lock:
                self.file.write("\n]\n")
                self.file.close()
                self.file = None


timeline = _Timeline()


def merge(out, paths):
    """Merges per-rank timeline files into one trace."""
    events = []
    for p in paths:
        with open(p) as f:
            text = f.read().rstrip()
        if not text.endswith("]"):
            text += "\n]"
        events.extend(json.loads(text))
    with open(out, "w") as f:
        json.dump(events, f)

