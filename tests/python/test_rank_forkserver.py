"""The test ranks' fork servers (Note [Rank fork servers] in rank_forkserver.py) give a
rank what a fresh `python script.py` gives it; each check runs the same script both ways.
"""
import json
import os

import pytest

from conftest import run_ranks

SCRIPT = """
import atexit, json, os, sys
opts = json.loads(sys.argv[1])
out = opts["dir"] + f"/rank{os.environ['RANK']}.json"
def at_exit():
    last = getattr(sys, "last_value", None)
    with open(out, "w") as f:
        json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0],
                   "hash": hash("smp"), "name": __name__, "rank": os.environ["RANK"],
                   "extra": os.environ.get("SMP_FORK_TEST"), "last": repr(last)}, f)
atexit.register(at_exit)
print("hello from", os.environ["RANK"])
if opts["end"] == "raise":
    raise ValueError("boom")
if opts["end"] == "exit3":
    sys.exit(3)
"""


@pytest.mark.parametrize("end, code", [("return", 0), ("raise", 1), ("exit3", 3)])
@pytest.mark.parametrize("fresh", ["0", "1"])
def test_a_forked_rank_is_a_fresh_interpreter(tmp_path, monkeypatch, end, code, fresh):
    monkeypatch.setenv("SMP_TEST_FRESH_PROCESSES", fresh)
    opts = json.dumps({"dir": str(tmp_path), "end": end})
    res = run_ranks(SCRIPT, 2, tmp_path, env={"SMP_FORK_TEST": "yes"}, args=(opts,))
    for r in res:
        assert r.returncode == code, r
        assert r.stdout == f"hello from {r.rank}\n", r
        assert ("ValueError: boom" in r.stderr) == (end == "raise"), r
        got = json.load(open(tmp_path / f"rank{r.rank}.json"))
        assert got["argv"] == [opts] and got["cwd"] == str(tmp_path), got
        assert got["path0"] == str(tmp_path) and got["name"] == "__main__", got
        assert got["rank"] == str(r.rank) and got["extra"] == "yes", got
        assert got["last"] == ("ValueError('boom')" if end == "raise" else "None"), got
    hashes = {json.load(open(tmp_path / f"rank{r}.json"))["hash"] for r in (0, 1)}
    assert len(hashes) == 2  # each rank its own string hash seed, as fresh processes


def test_a_hung_forked_rank_is_killed_at_the_timeout(tmp_path):
    res = run_ranks("import time\nprint('up', flush=True)\ntime.sleep(60)\n", 1, tmp_path,
                    timeout=3)
    assert res[0].returncode is None and res[0].stdout == "up\n", res[0]
    assert "killed at timeout" in res[0].stderr
