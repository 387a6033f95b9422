"""Persistent task threads of the pipeline (smp/pipeline.py)."""
import queue
import threading

__all__ = []


class Workers:
    """Persistent task threads. Starting a thread per microbatch every step costs real
    time (a stack, Python and torch thread state), so tasks run on threads kept from
    step to step; the most recently used idle thread is reused first (its caches are
    warm)."""

    def __init__(self, name):
        self.name = name
        self.cond = threading.Condition()
        self.idle = []     # inboxes of threads without work
        self.inboxes = []  # every thread's
        self.pending = 0   # callables submitted and not finished

    def _loop(self, inbox):
        while True:
            fn = inbox.get()
            if fn is None:
                return
            try:
                fn()
            finally:
                fn = None  # drop the job (and what it holds) now, not at the next one
                with self.cond:
                    self.pending -= 1
                    self.idle.append(inbox)
                    self.cond.notify_all()

    def spawn(self, fn):
        """Runs `fn` (which catches its own exceptions) on an idle or new thread."""
        with self.cond:
            self.pending += 1
            inbox = self.idle.pop() if self.idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            try:
                threading.Thread(target=self._loop, args=(inbox,), daemon=True,
                                 name=f"{self.name}{len(self.inboxes)}").start()
            except BaseException:
                with self.cond:
                    self.pending -= 1
                raise
            self.inboxes.append(inbox)
        inbox.put(fn)

    def wait_idle(self, timeout):
        """Waits until every submitted callable has returned to this pool's Python loop
        (a thread still in C++ when the interpreter exits would abort it)."""
        with self.cond:
            if not self.cond.wait_for(lambda: self.pending == 0, timeout=timeout):
                raise RuntimeError(f"smp: timed out after {timeout} s waiting for the "
                                   f"pipeline's task threads to finish ({self.pending} busy)")

    def stop(self):
        for inbox in self.inboxes:
            inbox.put(None)
        self.inboxes, self.idle = [], []
