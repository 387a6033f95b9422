"""tools/plan_costs.py, the replay of executed plans over measured action times: its
simulator agrees with Plan::simulate (smp_core/plan.cpp) on unit costs, the orders its
search finds keep the runtime's rules and are never longer than the executed plan, and
no order beats its bound."""
import os
import sys

import pytest

from smp import _C

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import plan_costs  # noqa: E402

KINDS = ["simple", "interleaved", "1f1b", "zero_bubble"]
PATHS = [[0, 1, 0], [0, 1], [0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 1, 0], [0, 2, 1, 3, 0]]


def model_for(plan, kind, path, m, lha, forward, backward, delay):
    return plan_costs.Model(path, m, plan.window(), forward, backward, delay,
                            simple=kind == "simple", last_hop_accumulates=lha)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_unit_costs_replay_as_plan_simulate_does(path, kind):
    for lha in (False, True):
        for m in (4, 8):
            plan = _C.Plan.executed(kind, m, max(path) + 1, 4, path, lha)
            forward, backward = [1.0] * len(path), [2.0] * len(path)
            if not lha:  # Note [Last hop's gradients]: the loss hop costs nothing
                forward[-1] = backward[-1] = 0.0
            model = model_for(plan, kind, path, m, lha, forward, backward, 0.0)
            lists = model.lists(plan)
            assert model.simulate(lists) == plan.simulate()["makespan"], (path, kind, lha, m)
            assert all(model.valid(lst) for lst in lists), (path, kind, lha, m)


@pytest.mark.parametrize("kind", ["simple", "interleaved", "1f1b"])
def test_search_keeps_the_rules_and_never_loses(kind):
    path, m = [0, 1, 0], 8
    plan = _C.Plan.executed(kind, m, 2, 4, path, False)
    model = model_for(plan, kind, path, m, False, [1.75, 1.85, 0.09], [3.45, 3.45, 0.17], 0.08)
    lists = model.lists(plan)
    executed = model.simulate(lists)
    best, best_ms = plan_costs.search(model, lists, 3000)
    assert best_ms <= executed
    assert best_ms == model.simulate(best)
    assert all(model.valid(lst) for lst in best)
    assert sorted(a for lst in best for a in lst) == sorted(a for lst in lists for a in lst)
    assert model.bound() <= best_ms + 1e-9


def test_valid_refuses_what_the_runtime_would_not_run():
    path, m = [0, 1, 0], 8
    plan = _C.Plan.executed("interleaved", m, 2, 4, path, False)
    model = model_for(plan, "interleaved", path, m, False, [1] * 3, [2] * 3, 0.0)
    driver = model.lists(plan)[0]
    assert model.valid(driver)
    starts = [i for i, a in enumerate(driver) if a[0] == "F" and a[2] == 0]
    swapped = list(driver)  # microbatches 0 and 1 started out of order
    swapped[starts[0]], swapped[starts[1]] = swapped[starts[1]], swapped[starts[0]]
    assert not model.valid(swapped)
    loss = next(i for i, a in enumerate(driver) if a in model.pairs)
    split = driver[:loss + 1] + driver[loss + 2:] + [driver[loss + 1]]  # the loss's B moved away
    assert not model.valid(split)
    backs = [i for i, a in enumerate(driver) if a[0] == "B" and a[2] == 0]
    late = list(driver)  # microbatch 1's gradient before microbatch 0's
    late[backs[0]], late[backs[1]] = late[backs[1]], late[backs[0]]
    assert not model.valid(late)
