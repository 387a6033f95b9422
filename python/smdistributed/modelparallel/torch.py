"""`import smdistributed.modelparallel.torch as smp` gives the `smp` module itself."""
import sys

import smp

sys.modules[__name__] = smp
