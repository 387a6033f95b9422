"""A bounded memo: the one cache type of the package.

Remote calls memoize what repeats every microbatch and every step (a call's pickled
metadata, its decoded form, the plan of running it). The keys are few in a real model,
but nothing bounds them in principle (a module called with ever new keyword values),
so each memo holds at most `cap` entries.
"""

__all__ = []

_MISSING = object()


class Memo:
    """A dict of computed values with at most `cap` entries.

    Eviction: none. A full memo keeps what it holds and computes any other key on every
    lookup. The keys memoized here recur from the first step on, so the first `cap`
    seen are the ones worth keeping, and a lookup never pays for bookkeeping (an LRU
    would reorder on every hit).

    Thread-safety: the threads of a pipeline share a memo; each operation is one dict
    operation under the GIL. Two threads may compute the same key at once: both get an
    equal value and one of them is kept.
    """

    __slots__ = ("cap", "_values")

    def __init__(self, cap=4096):
        if not isinstance(cap, int) or cap < 0:
            raise ValueError(f"smp: Memo cap={cap!r} is not an integer >= 0")
        self.cap = cap
        self._values = {}

    def get(self, key, compute, keep=None):
        """The value of `key`: the memoized one, else `compute()`, memoized while there
        is room and, if `keep` is given, only when `keep(value)` is true."""
        value = self._values.get(key, _MISSING)
        if value is _MISSING:
            value = compute()
            if len(self._values) < self.cap and (keep is None or keep(value)):
                self._values[key] = value
        return value

    def __contains__(self, key):
        return key in self._values

    def __len__(self):
        return len(self._values)

    def clear(self):
        self._values.clear()
