"""`make bench`: runs every benchmark; each prints one JSON line."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHES = ["ddp.py", "pipeline.py", "checkpoint.py", "powersgd.py", "init.py",
           "activation_checkpointing.py", "memory.py", "mixed_precision.py", "hosts.py"]

if __name__ == "__main__":
    failed = 0
    for name in BENCHES:
        rc = subprocess.call([sys.executable, os.path.join(HERE, name)])
        if rc:
            print(f"bench {name} failed with exit code {rc}", file=sys.stderr)
            failed += 1
    sys.exit(1 if failed else 0)
