"""`smdistributed.modelparallel`: SMP v1's package name, served by smp.

Note [Two versions]: `__version__` here is the SMP API level smp implements
(`smp.SMP_API_VERSION`), because that is what clients compare: Hugging Face's Trainer
takes its SMP >= 1.10 paths (`smp.resume_from_checkpoint`, fp16, `user_content.pt`)
from `from smdistributed.modelparallel import __version__`. `smp.__version__` is smp's
own release.
"""
import smp as _smp

__version__ = _smp.SMP_API_VERSION
