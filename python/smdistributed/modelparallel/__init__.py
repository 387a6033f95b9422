"""`smdistributed.modelparallel`: SMP v1's package name, served by smp."""
import smp as _smp

__version__ = _smp.__version__
