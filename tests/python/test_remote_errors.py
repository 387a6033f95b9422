"""smp.remote_errors: an exception crossing pp ranks keeps its type, its origin's
traceback text, origin rank and schedule cell (Note [One traceback per error]). No
processes: the rank this process claims to be is set here (global rank 2, pp rank 1)."""
import pickle

import pytest

from smp import remote_errors
from smp.task import current as task


@pytest.fixture(autouse=True)
def rank_two(monkeypatch):
    monkeypatch.setattr(remote_errors, "rank", lambda: 2)
    monkeypatch.setattr(remote_errors, "pp_rank", lambda: 1)


def raised(exc):
    try:
        raise exc
    except type(exc) as e:
        return e


def test_payload_round_trip_keeps_type_text_origin_and_cell():
    exc = raised(KeyError("kaboom"))
    exc._smp_cell = (1, 3, True)
    got, text, origin = remote_errors.remote_exception(remote_errors.error_payload(exc))
    assert type(got) is KeyError and got.args == ("kaboom",)
    assert origin == 2 and got._smp_cell == (1, 3, True)
    assert "raised on rank 2, pp rank 1" in text and "KeyError: 'kaboom'" in text


def test_the_cell_comes_from_the_task_when_the_exception_has_none():
    task.mb, task.backward = 5, True
    try:
        got, _, _ = remote_errors.remote_exception(
            remote_errors.error_payload(raised(ValueError("v"))))
    finally:
        task.mb, task.backward = None, False
    assert got._smp_cell == (1, 5, True)


def test_a_forwarded_exception_keeps_its_origin_text():
    first, text, _ = remote_errors.remote_exception(
        remote_errors.error_payload(raised(RuntimeError("first"))))
    again, text2, _ = remote_errors.remote_exception(remote_errors.error_payload(first))
    assert text2 == text  # no chain of chains


def test_an_unpicklable_exception_travels_as_its_text():
    class Local(Exception):  # not importable by pickle
        pass
    got, _, _ = remote_errors.remote_exception(remote_errors.error_payload(raised(Local("x"))))
    assert type(got) is RuntimeError and "Local: x" in str(got)


def test_raise_remote_prefers_the_origins_own_object():
    mine = raised(KeyError("own"))
    meta = remote_errors.error_payload(mine)
    with pytest.raises(KeyError) as info:
        remote_errors.raise_remote(meta, lambda exc: mine)  # this rank is the origin
    assert info.value is mine
    with pytest.raises(KeyError) as info:
        remote_errors.raise_remote(meta)
    assert info.value is not mine
    assert isinstance(info.value.__cause__, remote_errors.RemoteTraceback)
    assert "KeyError: 'own'" in str(info.value.__cause__)
    assert pickle.loads(meta)[3] == 2
