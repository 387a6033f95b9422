"""Fails on rank 1 while SMP_RESTART_COUNT < the first argument, then succeeds."""
import os
import sys

count = int(os.environ["SMP_RESTART_COUNT"])
rank = int(os.environ["RANK"])
print(f"rank {rank} attempt {count}")
if rank == 1 and count < int(sys.argv[1]):
    sys.exit(3)
