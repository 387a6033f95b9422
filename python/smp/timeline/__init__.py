"""`SMP_TIMELINE=path`: each rank writes Chrome/Perfetto trace events of its steps to
`path.rank<N>.json` (one JSON array per file, openable in chrome://tracing or
ui.perfetto.dev; merge ranks with `python3 -m smp.timeline out.json path.rank*.json`).

Events are complete events ("ph": "X") with the rank as pid and the microbatch task as
tid, so each rank is a process row and each microbatch a thread row. When the variable
is unset, `span()` is a no-op context manager (no allocation on the hot path).

Bounds (see docs/pipeline.md, "Timeline"):
- `SMP_TIMELINE_STEPS=a:b` records the pipelined steps a .. b-1 only (0-based: step 0
  is the first `@smp.step` call, which also traces and partitions; `a:` has no end).
  After step b-1 the file is closed.
- `SMP_TIMELINE_MAX_MB` (a number > 0, default 64) caps each rank's file. When the
  next event would cross it, the rank stops recording.
Either way the rank writes one last instant event, "smp timeline stopped" (its reason
names the variable), closes the array (the file is valid JSON from then on) and
records nothing more; the job runs on. Stopping keeps the window chosen (or the job's
first steps); a ring of the last steps would have to hold them in memory and rewrite
the file, and would be lost to a crash or a SIGKILL, which is when a trace is wanted.
"""
import contextlib
import json
import os
import threading
import time

import smp._C as _C

__all__ = []

ENV = "SMP_TIMELINE"
ENV_MAX_MB = "SMP_TIMELINE_MAX_MB"
ENV_STEPS = "SMP_TIMELINE_STEPS"
DEFAULT_MAX_MB = 64.0
# Room kept for the closing instant event and "]": its text is well under this.
_CLOSING_RESERVE = 512


def max_bytes_from_env():
    """`SMP_TIMELINE_MAX_MB` in bytes (DEFAULT_MAX_MB when unset).

    Raises:
        ConfigError: the value is not a number > 0.
    """
    value = os.environ.get(ENV_MAX_MB, "").strip()
    if not value:
        return int(DEFAULT_MAX_MB * (1 << 20))
    try:
        mb = float(value)
    except ValueError:
        mb = -1.0
    if not mb > 0 or mb == float("inf"):
        raise _C.ConfigError(f"smp: environment {ENV_MAX_MB}='{value}' is not a number > 0 "
                             f"(megabytes per rank's timeline file; default {DEFAULT_MAX_MB:g})")
    return max(1, int(mb * (1 << 20)))


def steps_from_env():
    """`SMP_TIMELINE_STEPS` as (first, end): steps first .. end-1; end None: no end.

    Raises:
        ConfigError: the value is not `a:b` with integers 0 <= a < b, or `a:`.
    """
    value = os.environ.get(ENV_STEPS, "").strip()
    if not value:
        return 0, None
    first, sep, end = value.partition(":")
    try:
        a = int(first) if first.strip() else 0
        b = int(end) if end.strip() else None
        ok = sep == ":" and a >= 0 and (b is None or b > a)
    except ValueError:
        ok = False
    if not ok:
        raise _C.ConfigError(f"smp: environment {ENV_STEPS}='{value}' is not a step window "
                             "'a:b' (integers 0 <= a < b: steps a .. b-1, 0-based) or 'a:' "
                             "(from step a on)")
    return a, b


class _Timeline:
    def __init__(self):
        self.path = None
        self.file = None
        self.lock = threading.Lock()
        self.rank = 0
        self.t0 = 0.0  # CLOCK_MONOTONIC is shared by the processes of a machine
        self.size = 0
        self.max_bytes = 0
        self.first_step, self.end_step = 0, None
        self.step = -1  # pipelined steps begun on this rank (begin_step)
        self.recording = False
        self.stopped = False

    def start(self, rank):
        """Opens `$SMP_TIMELINE.rank<rank>.json` when SMP_TIMELINE is set.

        Raises:
            ConfigError: a bad SMP_TIMELINE_MAX_MB or SMP_TIMELINE_STEPS.
        """
        base = os.environ.get(ENV)
        if not base:
            return
        self.max_bytes = max_bytes_from_env()
        self.first_step, self.end_step = steps_from_env()
        self.rank = rank
        self.step = -1
        self.recording = self.first_step == 0
        self.stopped = False
        self.path = f"{base}.rank{rank}.json"
        self.file = open(self.path, "w")
        head = "[\n" + json.dumps({"name": "process_name", "ph": "M", "pid": rank,
                                   "args": {"name": f"rank {rank}"}})
        self.file.write(head)
        self.size = len(head)

    @property
    def enabled(self):
        return self.file is not None

    def event(self, name, start, end, mb=None, **args):
        tid = f"mb {mb}" if mb is not None else threading.current_thread().name
        ev = {"name": name, "ph": "X", "pid": self.rank, "tid": tid,
              "ts": (start - self.t0) * 1e6, "dur": (end - start) * 1e6}
        if args:
            ev["args"] = args
        text = ",\n" + json.dumps(ev)  # ASCII (ensure_ascii): characters are bytes
        with self.lock:
            if self.file is None:
                return
            if self.size + len(text) + _CLOSING_RESERVE > self.max_bytes:
                self._close_locked(f"{ENV_MAX_MB}: {self.max_bytes} bytes reached", end)
                return
            self.file.write(text)
            self.size += len(text)

    @contextlib.contextmanager
    def _span(self, name, mb, args):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.event(name, start, time.perf_counter(), mb, **args)

    def span(self, name, mb=None, **args):
        if self.file is None or not self.recording:
            return contextlib.nullcontext()
        return self._span(name, mb, args)

    def begin_step(self):
        """A pipelined step begins on this rank (every pp rank calls it once per step,
        from the step's main thread): applies SMP_TIMELINE_STEPS."""
        if self.file is None:
            return
        self.step += 1
        if self.end_step is not None and self.step >= self.end_step:
            with self.lock:
                if self.file is not None:
                    self._close_locked(f"{ENV_STEPS}: steps {self.first_step}.."
                                       f"{self.end_step - 1} recorded", time.perf_counter())
            return
        self.recording = self.step >= self.first_step

    def _close_locked(self, stop_reason=None, at=None):
        tail = ""
        if stop_reason is not None:
            self.stopped = True
            tail = ",\n" + json.dumps({
                "name": "smp timeline stopped", "ph": "i", "s": "g", "pid": self.rank,
                "tid": "smp", "ts": (at - self.t0) * 1e6,
                "args": {"reason": f"{stop_reason}; no events recorded after this"}})
        self.file.write(tail + "\n]\n")
        self.size += len(tail) + 3
        self.file.close()
        self.file = None

    def close(self):
        with self.lock:
            if self.file is not None:
                self._close_locked()


timeline = _Timeline()


def merge(out, paths):
    """Merges per-rank timeline files into one trace (a file a killed rank left
    without its closing bracket is read too).

    Args:
        out: the merged file to write.
        paths: the per-rank files (`$SMP_TIMELINE.rank<N>.json`).
    """
    events = []
    for p in paths:
        with open(p) as f:
            text = f.read().rstrip()
        if not text.endswith("]"):
            text += "\n]"
        events.extend(json.loads(text))
    with open(out, "w") as f:
        json.dump(events, f)
