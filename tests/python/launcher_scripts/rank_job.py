"""A configurable rank for failure tests.

Usage: rank_job.py PID_FILE [--fail-rank R] [--code C] [--kill-rank R] [--sleep S]
Every rank appends "pid <pid>" to PID_FILE; rank 0 also starts a grandchild (`sleep`) in its
process group and records it. Rank --fail-rank prints lines and a timestamp, then exits with
--code; rank --kill-rank SIGKILLs itself; every other rank sleeps --sleep seconds.
"""
import argparse
import os
import signal
import subprocess
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("pid_file")
p.add_argument("--fail-rank", type=int, default=-1)
p.add_argument("--code", type=int, default=1)
p.add_argument("--kill-rank", type=int, default=-1)
p.add_argument("--sleep", type=float, default=60)
p.add_argument("--wait-ranks", type=int, default=0,
               help="failing rank waits until this many pid lines exist")
a = p.parse_args()
rank = int(os.environ["RANK"])


def record(pid):
    with open(a.pid_file, "a") as f:
        f.write(f"pid {pid}\n")


record(os.getpid())
if rank == 0:
    record(subprocess.Popen(["sleep", str(a.sleep + 30)]).pid)


def wait_for_peers():
    deadline = time.time() + 10
    while time.time() < deadline:
        with open(a.pid_file) as f:
            if len(f.read().splitlines()) >= a.wait_ranks:
                return
        time.sleep(0.02)


if rank == a.fail_rank:
    wait_for_peers()
    for i in range(30):
        print(f"rank {rank} progress line {i}")
    print(f"FAILING_AT {time.time():.6f}", file=sys.stderr)
    sys.exit(a.code)
if rank == a.kill_rank:
    wait_for_peers()
    print("about to be killed")
    os.kill(os.getpid(), signal.SIGKILL)
print(f"rank {rank} sleeping")
time.sleep(a.sleep)
