"""The parts of a partial save: which ones a rank reads, and how what several parts
hold merges into one object (smp.load, and merge.py outside a job).

Partial checkpoints are keyed by name, so they reshard: a job with pp_size B reads the
A parts of a save, each rank the parts that hold its layers."""
from smp import tp_state
from smp.checkpoint._common import PARTIAL_KEY

__all__ = []


def tp_parts(paths_count, saved_pp, pp_rank, pp_size, tp_rank, tp_size):
    """The parts of a save of `paths_count` parts by a job of pp size `saved_pp` that
    this rank reads: part pp * saved_tp + tp (Note [Slices in checkpoints] in
    smp/tp_state.py) for the saved pp ranks my_parts gives, and of the saved tp ranks
    only its own when tp is the same, else all of them (to cut its slices from)."""
    saved_pp = saved_pp if saved_pp > 0 and paths_count % saved_pp == 0 else paths_count
    saved_tp = paths_count // saved_pp
    tps = [tp_rank] if saved_tp == tp_size else list(range(saved_tp))
    return [p * saved_tp + t for p in my_parts(saved_pp, pp_rank, pp_size) for t in tps]


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
    if all(isinstance(o, dict) for o in objs) and tp_state.has_table(objs):
        # Note [Slices in checkpoints]: the tp ranks' slices of an entry combine.
        return tp_state.merge(objs, merge)
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
