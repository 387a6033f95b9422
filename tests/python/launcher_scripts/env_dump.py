"""Prints the launcher-provided environment of this rank as one JSON line, then its argv."""
import json
import os
import sys

KEYS = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
        "MASTER_PORT", "SMP_CONFIG", "SMP_RESTART_COUNT", "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS", "SMP_JOB_SECRET"]
import threading

# The CPUs this rank may run on, seen from its main thread and from a thread it starts.
cpus = {}
t = threading.Thread(target=lambda: cpus.update(thread=sorted(os.sched_getaffinity(0))))
t.start()
t.join()
print("ENV " + json.dumps({k: os.environ.get(k) for k in KEYS} | {"argv": sys.argv[1:]}
                          | {"cpus": sorted(os.sched_getaffinity(0)), "thread_cpus": cpus["thread"]}))
