"""smp.workers.Workers: persistent task threads. No processes."""
import threading
import time

import pytest

from smp.workers import Workers


def test_every_spawned_callable_runs_and_threads_are_reused():
    w = Workers("t")
    seen, lock = [], threading.Lock()

    def job(i):
        with lock:
            seen.append((i, threading.current_thread().name))
    try:
        for i in range(5):
            w.spawn(lambda i=i: job(i))
            w.wait_idle(10)
        assert sorted(i for i, _ in seen) == list(range(5))
        assert {n for _, n in seen} == {"t0"}  # one at a time: the idle thread is reused
    finally:
        w.stop()


def test_concurrent_callables_get_threads_of_their_own():
    w = Workers("c")
    gate = threading.Barrier(3, timeout=10)
    try:
        for _ in range(3):
            w.spawn(gate.wait)  # all three must run at once to pass the barrier
        w.wait_idle(10)
        assert len(w.inboxes) == 3
    finally:
        w.stop()


def test_wait_idle_names_what_it_waited_for():
    w = Workers("slow")
    release = threading.Event()
    try:
        w.spawn(lambda: release.wait(10))
        with pytest.raises(RuntimeError, match=r"timed out after 0.2 s waiting for the "
                                               r"pipeline's task threads to finish \(1 busy\)"):
            w.wait_idle(0.2)
    finally:
        release.set()
        w.wait_idle(10)
        w.stop()


def test_a_job_is_dropped_when_it_returns():
    w = Workers("d")
    import weakref

    class Big:
        pass
    obj = Big()
    ref = weakref.ref(obj)

    def job(o=obj):
        return o
    try:
        w.spawn(job)
        del obj, job
        w.wait_idle(10)
        deadline = time.time() + 5
        while ref() is not None and time.time() < deadline:
            time.sleep(0.01)
        assert ref() is None  # the idle thread does not keep its last job alive
    finally:
        w.stop()
