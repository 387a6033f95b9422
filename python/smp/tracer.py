"""The first step's trace: one microbatch through the whole model, recording what
the partitioner (C++, `smp._C.partition`) needs: the module tree, call order and
counts, parameter/buffer bytes, output bytes, and optionally time and memory.
"""
import os
import time
import traceback

import torch

import smp._C as _C
from smp import memory_estimate, nested, optimizer_sharding
from smp.partitioning import manual_partition_of
from smp.process_state import state

__all__ = []


def _tensor_bytes(value):
    return sum(t.numel() * t.element_size() for t in nested.tensor_leaves(value))


def module_table(root):
    """Pre-order (name, module, parent index) of the unique modules under `root`."""
    table, index = [], {}
    for name, module in root.named_modules():
        parent = -1
        if name:
            parent_name = name.rsplit(".", 1)[0] if "." in name else ""
            parent = index[parent_name]
        index[name] = len(table)
        table.append((name, module, parent))
    return table


class Trace:
    """Records module calls with forward hooks while it is active (a context manager)."""

    def __init__(self, root, measure_time=False, measure_memory=False):
        self.table = module_table(root)
        self.measure_time = measure_time
        self.measure_memory = measure_memory and torch.cuda.is_available()
        n = len(self.table)
        self.first_call = [-1] * n
        self.calls = [0] * n
        self.activation_bytes = [0] * n
        self.time_ms = [0.0 if measure_time else -1.0] * n
        self.mem_bytes = [0 if self.measure_memory else -1] * n
        self._order = 0
        self._stack = []  # (node, start time, children's time, start memory, children's memory)
        self._handles = []

    def _pre(self, i):
        def hook(_module, _inputs):
            if self.first_call[i] < 0:
                self.first_call[i] = self._order
                self._order += 1
            self.calls[i] += 1
            mem = torch.cuda.memory_allocated() if self.measure_memory else 0
            self._stack.append([i, time.perf_counter(), 0.0, mem, 0])
        return hook

    def _post(self, i):
        def hook(_module, _inputs, outputs):
            self.activation_bytes[i] += _tensor_bytes(outputs)
            node, start, child_t, mem0, child_m = self._stack.pop()
            elapsed = time.perf_counter() - start
            used = (torch.cuda.memory_allocated() - mem0) if self.measure_memory else 0
            if self.measure_time:
                self.time_ms[i] += max(0.0, elapsed - child_t) * 1000.0
            if self.measure_memory:
                self.mem_bytes[i] += max(0, used - child_m)
            if self._stack:
                self._stack[-1][2] += elapsed
                self._stack[-1][4] += used
        return hook

    def __enter__(self):
        for i, (_, module, _) in enumerate(self.table):
            self._handles.append(module.register_forward_pre_hook(self._pre(i)))
            self._handles.append(module.register_forward_hook(self._post(i)))
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []

    def where_it_failed(self, exc):
        """Where the traced model raised `exc`: the module whose call was in progress
        (the innermost) and the last line of the model's own code that ran (not
        torch's, not smp's), as a phrase for the error every rank raises."""
        parts = []
        if self._stack:  # a call that raised never popped its entry
            name, module, _ = self.table[self._stack[-1][0]]
            parts.append(f"in module '{name or '<root>'}' ({type(module).__name__})")
        skip = tuple(os.path.dirname(os.path.abspath(f)) + os.sep  # torch's, smp's
                     for f in (getattr(torch, "__file__", None), __file__) if f)
        user = [f for f in traceback.extract_tb(exc.__traceback__)
                if not os.path.abspath(f.filename).startswith(skip)]
        if user:
            f = user[-1]
            parts.append(f"at {f.filename}:{f.lineno}" +
                         (f": {f.line.strip()}" if f.line else ""))
        return " ".join(["tracing the first step", ", ".join(parts)]).strip()

    def nodes(self):
        """The trace as plain records (picklable, for the broadcast from pp rank 0)."""
        records = []
        for i, (name, module, parent) in enumerate(self.table):
            direct = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
            records.append(dict(
                name=name, parent=parent,
                param_bytes=sum(t.numel() * t.element_size() for t in direct),
                activation_bytes=self.activation_bytes[i], time_ms=self.time_ms[i],
                mem_bytes=self.mem_bytes[i], first_call=self.first_call[i],
                calls=self.calls[i], manual_partition=manual_partition_of(module),
                follow_parent=parent >= 0 and _pinned(self.table[parent][1], name)))
        return records


def _pinned(parent, name):
    """Whether `parent`'s forward uses the child `name`'s tensors directly, so the child
    must be on its partition (Note [Blocks stay whole] in partition/partition.cpp): a
    module's `_smp_pinned_children` is True (all) or the children's names."""
    pinned = getattr(parent, "_smp_pinned_children", False)
    return pinned is True or (isinstance(pinned, tuple) and name.rsplit(".", 1)[-1] in pinned)


def to_module_nodes(records):
    nodes = []
    for r in records:
        n = _C.partition.ModuleNode()
        for key, value in r.items():
            setattr(n, key, value)
        nodes.append(n)
    return nodes


def make_plan(records):
    """Runs the C++ partitioner on the trace with the config's options."""
    cfg = state.cfg
    opts = _C.partition.Options()
    opts.partitions = cfg.partitions
    opts.memory_weight = cfg.memory_weight
    if getattr(cfg, "optimize", "speed") == "memory":
        # Note [Cost model]: the bytes a stage really holds: each parameter with its
        # gradient and optimizer state (a share when sharded), and the activations of
        # the microbatches in flight.
        opts.param_memory_factor = memory_estimate.param_memory_factor(
            state.optimizer, optimizer_sharding.shards())
        opts.activation_memory_factor = float(min(cfg.active_microbatches, cfg.microbatches))
    opts.auto_partition = cfg.auto_partition
    opts.default_partition = cfg.default_partition
    nodes = to_module_nodes(records)
    return nodes, _C.partition.make_plan(nodes, opts)

