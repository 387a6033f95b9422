"""`smp.core`: initialisation, topology queries, process groups and object
collectives, as one namespace for scripts and tests that write `smp.core.X`.

Inside the package only `smp/__init__.py` imports it, for the name `smp.core`; every
module imports the concept module it uses, so its imports say which way it depends
(docs/architecture.md, "The Python package's layers"). Each concept lives in its own
module; this one only re-exports them:
- `process_state`: `smp.state` and the check that smp is initialised;
- `runtime`: smp.init and smp.shutdown;
- `groups`: CommGroup and the torch.distributed process groups;
- `ranks`: RankType, rank and size getters, group members;
- `collectives`: barrier, allgather, gather, send, recv_from, broadcast, and the
  naming of calls (Note [Naming the call]).
"""
import smp._C as _C
from smp.collectives import (  # noqa: F401
    STEP_CALL, agree_call, allgather, api_call, barrier, broadcast, dp_barrier, gather,
    mp_barrier, pp_barrier, recv_from, send,
)
from smp.groups import (  # noqa: F401
    CommGroup, choose_backend, get_dp_process_group, get_mp_process_group,
    get_pp_process_group, get_rdp_process_group, get_tp_process_group,
    get_world_process_group,
)
from smp.process_state import (  # noqa: F401
    is_initialized, is_tracing, num_microbatches, require_init, state,
)
from smp.ranks import (  # noqa: F401
    RankType, dp_rank, dp_size, get_dp_group, get_mp_group, get_pp_group, get_rdp_group,
    get_tp_group, local_rank, local_size, members, mp_rank, mp_size, pp_rank, pp_size, rank,
    rdp_rank, rdp_size, size, tp_rank, tp_size,
)
from smp.runtime import init, shutdown  # noqa: F401

__all__ = []

ConfigError = _C.ConfigError
SMPTimeoutError = _C.SMPTimeoutError

# The names these had when they were private to core.py.
_choose_backend, _members, _require_init = choose_backend, members, require_init
