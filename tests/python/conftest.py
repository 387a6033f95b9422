"""Shared helpers: run a script as N real ranks (processes) on loopback."""
import atexit
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.abspath(os.environ.get("SMP_BUILD_DIR", os.path.join(REPO, "build")))
# Ranks and helper processes run with the interpreter running pytest (make test: .venv's,
# whose torch the build used), unless SMP_PYTHON names another.
PYTHON = os.environ.get("SMP_PYTHON") or sys.executable
sys.path.insert(0, os.path.join(BUILD, "python"))

import rank_forkserver  # noqa: E402  (beside this file)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankResult:
    def __init__(self, rank, returncode, stdout, stderr):
        self.rank, self.returncode, self.stdout, self.stderr = rank, returncode, stdout, stderr

    def __repr__(self):
        return (f"<rank {self.rank} rc={self.returncode}\n--- stdout\n{self.stdout[-3000:]}"
                f"\n--- stderr\n{self.stderr[-3000:]}>")


def rank_env(rank, world, port, extra=None):
    env = dict(os.environ)
    env.update({
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "PYTHONPATH": os.path.join(BUILD, "python") + os.pathsep + os.path.join(REPO, "tests", "python"),
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
    })
    env.pop("SMP_CONFIG", None)
    env.pop("SM_HP_MP_PARAMETERS", None)
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


_fork_servers = {}  # rank slot -> rank_forkserver.ForkServer (Note [Rank fork servers])


def _start_rank(slot, argv, env, cwd):
    """A Popen-like rank: forked from slot's pre-imported server when its start-up
    environment allows (rank_forkserver.py), else a fresh interpreter."""
    if os.environ.get("SMP_TEST_FRESH_PROCESSES") != "1":
        server = _fork_servers.get(slot)
        if server is None:
            server = _fork_servers[slot] = rank_forkserver.ForkServer(
                PYTHON, rank_env(slot, 1, 0))
        if rank_forkserver.startup_env(env) == server.env:
            stem = os.path.join(server.output_dir, f"rank{slot}_{time.monotonic_ns()}")
            return server.spawn(argv, env, cwd, stem + ".out", stem + ".err")
    return subprocess.Popen([PYTHON, *argv], env=env, cwd=str(cwd), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@atexit.register
def _stop_fork_servers():
    for server in _fork_servers.values():
        server.close()


def run_ranks(script, world, tmp_path, env=None, per_rank_env=None, timeout=120, args=()):
    """Runs `script` (source text) as `world` processes; returns a RankResult per rank.

    Every process is killed at `timeout` (then returncode is None), so a hang fails the
    test instead of stalling the suite.
    """
    path = tmp_path / f"script_{time.monotonic_ns()}.py"
    path.write_text(textwrap.dedent(script))
    port = free_port()
    procs = []
    for r in range(world):
        e = rank_env(r, world, port, env)
        if per_rank_env:
            e.update({k: str(v) for k, v in per_rank_env(r).items()})
        procs.append(_start_rank(r, [str(path), *args], e, tmp_path))
    deadline = time.monotonic() + timeout
    results = []
    for r, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
            results.append(RankResult(r, p.returncode, out, err))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
            results.append(RankResult(r, None, out, err + "\n[killed at timeout]"))
    return results


def assert_all_ok(results):
    bad = [r for r in results if r.returncode != 0]
    assert not bad, "\n".join(map(repr, bad))


def run_with_options(script, world, tmp_path, opts, timeout=150, **kw):
    """run_ranks with `opts` as the script's JSON argv[1]; asserts every rank passed."""
    import json
    res = run_ranks(script, world, tmp_path, args=(json.dumps(opts),), timeout=timeout, **kw)
    assert_all_ok(res)
    return res


@pytest.fixture
def ranks(tmp_path):
    """`ranks(script, world, **kw)` runs a multi-rank script and asserts every rank passed."""
    def run(script, world, check=True, **kw):
        res = run_ranks(script, world, tmp_path, **kw)
        if check:
            assert_all_ok(res)
        return res
    return run


# Note [One job for many cases]
# A rank's start-up (fork, smp's import, the store rendezvous) and its exit cost about
# as much as a small case itself. run_cases runs one script for several argument lists
# in a single job of `world` ranks, one case after the other, smp.shutdown() between
# them: each case calls smp.init itself and sets its own seeds, as a fresh process
# does, and its functions live in __main__'s globals, where smp.step and remote calls
# look them up (as tp_reference.one_job does). A case that fails ends the job there:
# that case and the ones after it report the failure. A case must not sys.exit.
_CASES_MAIN = """
import sys as _sys
import smp as _smp
_BODY = {body!r}
_CASES = {cases!r}
for _i, _argv in enumerate(_CASES):
    print("CASE_START", _i, flush=True)
    print("CASE_START", _i, file=_sys.stderr, flush=True)
    _sys.argv = _sys.argv[:1] + list(_argv)
    exec(compile(_BODY, "<case %d>" % _i, "exec"), _sys.modules["__main__"].__dict__)
    _smp.shutdown()
    print("CASE_DONE", _i, flush=True)
"""


class CaseJob:
    """The results of run_cases: `stdout(i)` is each rank's output of case i, once every
    rank finished it; otherwise it fails, with what the ranks printed."""

    def __init__(self, results, n):
        self.results, self.n = results, n

    def stdout(self, i):
        outs = []
        for r in self.results:
            text = r.stdout or ""
            start, done = f"CASE_START {i}\n", f"CASE_DONE {i}\n"
            if start not in text or done not in text:
                raise AssertionError(f"case {i} of {self.n} did not finish on rank {r.rank} "
                                     "(a case fails the job where it fails):\n" +
                                     "\n".join(map(repr, self.results)))
            outs.append(text.split(start, 1)[1].split(done, 1)[0])
        last_done = all(f"CASE_DONE {self.n - 1}\n" in (r.stdout or "") for r in self.results)
        if last_done and any(r.returncode != 0 for r in self.results):  # the exit failed
            raise AssertionError("the job failed after its last case:\n" +
                                 "\n".join(map(repr, self.results)))
        return outs


def run_cases(script, cases, world, tmp_path, timeout_per_case=90, **kw):
    """Runs `script` once per argument list in `cases`, all in one job of `world` ranks
    (Note [One job for many cases]); returns a CaseJob."""
    cases = [list(map(str, c)) for c in cases]
    main = _CASES_MAIN.format(body=textwrap.dedent(script), cases=cases)
    res = run_ranks(main, world, tmp_path, timeout=60 + timeout_per_case * len(cases), **kw)
    return CaseJob(res, len(cases))
