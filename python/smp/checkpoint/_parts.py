"""The parts of a partial save: which ones a rank reads, and how what several parts
hold merges into one object (smp.load, and merge.py outside a job).

Partial checkpoints are keyed by name, so they reshard: a job with pp_size B reads the
A parts of a save, each rank the parts that hold its layers."""
from smp.checkpoint._common import PARTIAL_KEY

__all__ = []


def my_parts(parts, pp_rank, pp_size):
    """The parts of an A-part save this rank reads: contiguous blocks, so with a
    pipeline's layer order the parts a rank reads mostly hold the layers it owns."""
    if pp_size >= parts:
        return [pp_rank * parts // pp_size]
    return [p for p in range(parts) if p * pp_size // parts == pp_rank]


def merge(objs):
    """Merges what several parts of one save hold: dicts by key (recursively), optimizer
    param groups by index; any other value is taken from the first part."""
    if len(objs) == 1:
        return objs[0]
    if all(isinstance(o, dict) for o in objs):
        out, keys, seen = {}, [], set()
        for o in objs:
            for k in o:
                if k not in seen:
                    seen.add(k)
                    keys.append(k)
        for k in keys:
            vals = [o[k] for o in objs if k in o]
            if k == "param_groups" and all(isinstance(v, list) for v in vals):
                out[k] = _merge_param_groups(vals)
            elif k == PARTIAL_KEY:
                out[k] = any(vals)
            else:
                out[k] = merge(vals) if all(isinstance(v, dict) for v in vals) else vals[0]
        return out
    return objs[0]


def _merge_param_groups(lists):
    n = max(len(lst) for lst in lists)
    out = []
    for i in range(n):
        groups = [lst[i] for lst in lists if i < len(lst)]
        g = dict(groups[0])
        params = []
        for h in groups:
            params.extend(p for p in h.get("params", []) if p not in params)
        g["params"] = params
        out.append(g)
    return out
