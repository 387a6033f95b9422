"""`python3 -m smp.timeline OUT.json RANK_FILE...`: merges per-rank timeline files."""
import sys

from smp.timeline import merge

__all__ = []

if len(sys.argv) < 3:
    sys.exit("usage: python3 -m smp.timeline OUT.json RANK_FILE...")
merge(sys.argv[1], sys.argv[2:])
