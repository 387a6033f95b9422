"""`python -m smp.checkpoint merge [--key KEY] PART... OUT`: see smp/checkpoint/merge.py;
`to-dcp SRC DST [--tag T]`, `from-dcp SRC DST [--tag T]`: see smp/checkpoint/dcp.py."""
import sys

from smp.checkpoint import dcp
from smp.checkpoint.merge import main

__all__ = []

sys.exit(main(sys.argv[1:], commands=[dcp.add_commands]))
