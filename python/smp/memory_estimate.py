"""What a rank's training state costs per parameter, for the memory budget of a deferred
model (Note [Memory budget] in smp/deferred_init.py) and the partitioner's memory cost
under `optimize: "memory"` (Note [Cost model] in partition/detail/cost_model.h)."""

__all__ = []

# Optimizer state tensors per parameter, by torch.optim class name (each the
# parameter's size); SGD has one only with momentum.
_STATES_PER_PARAM = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2,
                     "Adadelta": 2, "SGD": 1, "RMSprop": 1, "Adagrad": 1, "Rprop": 2}


def states_per_param(optimizer):
    """(state tensors per parameter, the optimizer's class name or None). An optimizer
    not known yet, or not in the table, counts as Adam's 2."""
    opt = getattr(optimizer, "optimizer", optimizer)
    if opt is None:
        return 2, None
    name = type(opt).__name__
    if name == "SGD":
        return (1 if any(g.get("momentum", 0) for g in opt.param_groups) else 0), name
    return _STATES_PER_PARAM.get(name, 2), name


def param_memory_factor(optimizer, sharded_over=1):
    """Bytes of training state per parameter byte: the weight, its gradient and the
    optimizer's states (divided over `sharded_over` dp ranks when sharded)."""
    states, _ = states_per_param(optimizer)
    return 2.0 + states / max(1, sharded_over)
