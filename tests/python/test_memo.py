"""smp.memo.Memo: memoizes, stays bounded, and keeps only what `keep` allows. No
processes."""
import pytest

from smp.memo import Memo


def counting(fn):
    calls = []

    def compute(*a):
        calls.append(a)
        return fn(*a)
    return compute, calls


def test_a_key_is_computed_once():
    memo = Memo()
    compute, calls = counting(lambda k: k * 2)
    assert [memo.get(k, lambda k=k: compute(k)) for k in (1, 2, 1, 2, 1)] == [2, 4, 2, 4, 2]
    assert calls == [(1,), (2,)] and len(memo) == 2 and 1 in memo and 3 not in memo


def test_a_full_memo_keeps_its_entries_and_computes_the_rest_every_time():
    memo = Memo(cap=3)
    compute, calls = counting(lambda k: -k)
    for k in range(5):
        assert memo.get(k, lambda k=k: compute(k)) == -k
    assert len(memo) == 3 and [k in memo for k in range(5)] == [True] * 3 + [False] * 2
    calls.clear()
    for k in range(5):
        assert memo.get(k, lambda k=k: compute(k)) == -k
    assert calls == [(3,), (4,)]  # the first three stay memoized; no eviction


def test_default_cap_is_4096():
    memo = Memo()
    for k in range(5000):
        memo.get(k, lambda k=k: k)
    assert memo.cap == 4096 and len(memo) == 4096 and 4095 in memo and 4096 not in memo


def test_keep_decides_what_is_memoized():
    memo = Memo()
    compute, calls = counting(lambda k: [k] if k % 2 else (k,))
    for _ in range(2):
        for k in range(4):
            memo.get(k, lambda k=k: compute(k), keep=lambda v: isinstance(v, tuple))
    assert calls == [(0,), (1,), (2,), (3,), (1,), (3,)]
    assert len(memo) == 2 and 0 in memo and 1 not in memo


def test_none_is_a_value_and_zero_cap_memoizes_nothing():
    memo = Memo()
    compute, calls = counting(lambda: None)
    assert memo.get("k", compute) is None and memo.get("k", compute) is None
    assert len(calls) == 1
    empty = Memo(cap=0)
    compute, calls = counting(lambda: 1)
    empty.get("k", compute), empty.get("k", compute)
    assert len(calls) == 2 and len(empty) == 0
    memo.clear()
    assert len(memo) == 0


@pytest.mark.parametrize("cap", [-1, 2.5, "8"])
def test_a_bad_cap_is_refused(cap):
    with pytest.raises(ValueError, match=rf"smp: Memo cap={cap!r} is not an integer >= 0"):
        Memo(cap)
