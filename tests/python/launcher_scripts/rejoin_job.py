"""Records "pid <pid>" in the first argument's file and sleeps on attempt 0 (until the
job is stopped); exits 0 at once on later attempts."""
import os
import sys
import time

with open(sys.argv[1], "a") as f:
    f.write(f"pid {os.getpid()}\n")
count = int(os.environ["SMP_RESTART_COUNT"])
print(f"rank {os.environ['RANK']} attempt {count}", flush=True)
if count == 0:
    time.sleep(120)
