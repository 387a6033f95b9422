"""smp: model-parallel training for PyTorch with a C++ core.

A script written for ``smdistributed.modelparallel.torch`` runs with
``import smp`` (or unchanged, through the ``smdistributed`` shim).
"""
import torch  # noqa: F401  (must precede smp._C: it registers torch's pybind11 types)

import smp._C as _C
from smp import amp
from smp import checkpoint
from smp import ddp_comm_hooks
from smp import model
from smp import nn
from smp import optimizers
from smp.model import DistributedModel
from smp.grad_norm import clip_grad_norm_
from smp.agreement import ModelMismatchError
from smp.grad_guard import UnreducedGradientError
from smp.placement import TiedCopiesError
from smp.optimizer import DistributedOptimizer
from smp.partitioning import partition, set_partition
from smp.activation_checkpointing import set_activation_checkpointing
from smp.deferred_init import delay_param_initialization
from smp.tp_substitution import (
    model_creation, set_tensor_parallelism, tensor_parallelism, tp_register,
    tp_register_with_module,
)
import smp.nn.huggingface  # noqa: F401,E402  (smp.nn.huggingface.gpt2 / .bert: no transformers import)
from smp.step import StepOutput, step
from smp.checkpoint import (
    CheckpointError, load, resume_from_checkpoint, save, save_checkpoint,
)
from smp import core  # noqa: F401  (the compatibility namespace smp.core.X)
from smp.collectives import (
    allgather, barrier, broadcast, dp_barrier, gather, mp_barrier, pp_barrier, recv_from, send,
)
from smp.groups import (
    CommGroup, get_dp_process_group, get_mp_process_group, get_pp_process_group,
    get_rdp_process_group, get_tp_process_group, get_world_process_group,
)
from smp.process_state import is_initialized, is_tracing, num_microbatches, state
from smp.ranks import (
    RankType, dp_rank, dp_size, get_dp_group, get_mp_group, get_pp_group, get_rdp_group,
    get_tp_group, local_rank, local_size, mp_rank, mp_size, pp_rank, pp_size, rank, rdp_rank,
    rdp_size, size, tp_rank, tp_size,
)
from smp.runtime import init, shutdown

__version__ = "0.1.0"
# The SMP v1 API level smp implements: smdistributed.modelparallel.__version__.
# See Note [Two versions] in smdistributed/modelparallel/__init__.py.
SMP_API_VERSION = "1.10.0"

CommError = _C.CommError
ConfigError = _C.ConfigError
GradBucket = _C.GradBucket
SMPTimeoutError = _C.SMPTimeoutError

WORLD = CommGroup.WORLD
PP_GROUP = CommGroup.PP_GROUP
TP_GROUP = CommGroup.TP_GROUP
RDP_GROUP = CommGroup.RDP_GROUP
DP_GROUP = CommGroup.DP_GROUP
MP_GROUP = CommGroup.MP_GROUP
WORLD_RANK = RankType.WORLD_RANK
PP_RANK = RankType.PP_RANK
TP_RANK = RankType.TP_RANK
RDP_RANK = RankType.RDP_RANK
DP_RANK = RankType.DP_RANK
MP_RANK = RankType.MP_RANK

__all__ = [
    "init", "shutdown", "is_initialized", "state", "ConfigError", "CommError",
    "SMPTimeoutError", "rank", "size", "local_rank", "local_size", "mp_rank", "mp_size",
    "pp_rank", "pp_size", "dp_rank", "dp_size", "tp_rank", "tp_size", "rdp_rank",
    "rdp_size", "get_world_process_group", "get_mp_process_group", "get_dp_process_group",
    "get_pp_process_group", "get_tp_process_group", "get_rdp_process_group",
    "get_dp_group", "get_pp_group", "get_mp_group", "get_tp_group", "get_rdp_group",
    "CommGroup", "RankType", "WORLD", "PP_GROUP", "TP_GROUP", "RDP_GROUP", "DP_GROUP",
    "MP_GROUP", "WORLD_RANK", "PP_RANK", "TP_RANK", "RDP_RANK", "DP_RANK", "MP_RANK",
    "barrier", "pp_barrier", "dp_barrier", "mp_barrier", "broadcast", "send",
    "recv_from", "allgather", "gather", "num_microbatches", "is_tracing", "amp",
    "DistributedModel", "DistributedOptimizer", "GradBucket", "ddp_comm_hooks", "StepOutput", "step", "partition", "set_partition", "model",
    "clip_grad_norm_", "ModelMismatchError", "UnreducedGradientError", "TiedCopiesError", "__version__", "CheckpointError", "save", "load", "save_checkpoint",
    "resume_from_checkpoint", "set_activation_checkpointing", "delay_param_initialization", "model_creation",
    "nn", "optimizers",
    "tp_register", "tp_register_with_module", "tensor_parallelism", "set_tensor_parallelism",
]
