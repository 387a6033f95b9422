"""The process's smp state: `smp.state` in SMP v1 (`smp.state.cfg.<key>`), set by
`smp.init` (smp/runtime.py) and reset by `smp.shutdown`, and the check that it is set."""
from types import SimpleNamespace

from smp.task import current as _task

__all__ = []


class _State:
    """Process-wide state: `smp.state` in SMP v1 (`smp.state.cfg.<key>`)."""

    def __init__(self):
        self.initialized = False
        self.cfg = None
        self.topology = None
        self.rank = 0
        self.world_size = 1
        self.local_rank = 0
        self.local_size = 1
        self.store = None
        self.groups = {}
        self.model = None
        self.optimizer = None
        self.microbatch = 0
        self.tracing = False
        # SMP 1.10's (smp_to_hf, hf_to_smp) state-dict translations of tensor-parallel
        # modules; none without tensor parallelism. Hugging Face's save_pretrained walks
        # it when smdistributed.modelparallel.__version__ >= 1.10.
        self.module_manager = SimpleNamespace(translate_functions=[])

    def microbatch_of_task(self):
        """The microbatch the calling thread works on (pipeline tasks), else the step's."""
        return _task.mb if _task.mb is not None else self.microbatch


state = _State()


def require_init():
    """Raises RuntimeError unless smp.init has run."""
    if not state.initialized:
        raise RuntimeError("smp: not initialized; call smp.init() first")


def is_initialized():
    return state.initialized


def num_microbatches():
    require_init()
    return state.cfg.microbatches


def is_tracing():
    return state.tracing
