"""`python -m smp.checkpoint merge [--key KEY] PART... OUT`: see smp/checkpoint/merge.py."""
import sys

from smp.checkpoint.merge import main

__all__ = []

sys.exit(main(sys.argv[1:]))
