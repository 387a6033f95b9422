"""GPU suite (docs/gpu.md, tools/gpu_check.sh): the `ranks` fixture of tests/python, and a
clean skip of every test where torch sees no GPU."""
import importlib.util
import os
import sys

import pytest
import torch

_PY_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")
sys.path.insert(0, _PY_TESTS)
_spec = importlib.util.spec_from_file_location("smp_tests_common",
                                               os.path.join(_PY_TESTS, "conftest.py"))
common = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(common)
ranks = common.ranks  # noqa: F811  (the fixture, re-exported)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no GPU: torch.cuda.is_available() is False "
                                   "(run tools/gpu_check.sh on a GPU machine)")
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:  # the hook sees the whole session's items: only ours
        if str(item.fspath).startswith(here + os.sep):
            item.add_marker(skip)
