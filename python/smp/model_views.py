"""What a rank of a partitioned smp.DistributedModel holds: its modules, parameters
and buffers (SMP v1's local_* methods) and the partition plan. A mixin of
DistributedModel."""
from smp.model_state import canonical_key
from smp.ranks import pp_rank

__all__ = []


class LocalViewsMixin:
    def _is_local(self, module_name):
        return self._owner is None or self._owner[module_name] == pp_rank()

    def local_named_modules(self, memo=None, prefix=""):
        table = self._module_table if self._owner is not None else self.module.named_modules()
        for name, m in table:
            if self._is_local(name):
                name = canonical_key(name)  # Note [Plain names] (smp/model.py)
                yield (prefix + ("." if prefix and name else "") + name, m)

    def local_modules(self):
        return (m for _, m in self.local_named_modules())

    def local_named_parameters(self, prefix="", recurse=True):
        seen = set()
        for name, m in self.local_named_modules():
            for pname, p in m.named_parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    full = f"{name}.{pname}" if name else pname
                    yield (prefix + ("." if prefix else "") + full, p)

    def local_parameters(self, recurse=True):
        return (p for _, p in self.local_named_parameters())

    def local_named_buffers(self, prefix="", recurse=True):
        for name, m in self.local_named_modules():
            for bname, b in m.named_buffers(recurse=False):
                full = f"{name}.{bname}" if name else bname
                yield (prefix + ("." if prefix else "") + full, b)

    def local_buffers(self, recurse=True):
        return (b for _, b in self.local_named_buffers())

    def _key_owner(self, key):
        return self._owner[key.rsplit(".", 1)[0] if "." in key else ""]

    def partition_plan(self):
        """Module name -> {"partition": pp rank, "cost": normalized cost}."""
        if self._plan is None:
            return {name: {"partition": 0, "cost": 0.0}
                    for name, _ in self.module.named_modules()}
        return {name: {"partition": p, "cost": c} for name, p, c in self._plan}
