"""`import smdistributed.modelparallel.torch as smp` gives the `smp` module itself."""
import sys

import smp

sys.modules[__name__] = smp
# Its submodules too, under this name: `import smdistributed.modelparallel.torch.nn` and
# `from smdistributed.modelparallel.torch.optimizers import FusedLamb` would otherwise
# load second copies of smp's files (other classes) through smp's __path__.
for _name, _module in list(sys.modules.items()):
    if _name.startswith("smp."):
        sys.modules[__name__ + _name[len("smp"):]] = _module
