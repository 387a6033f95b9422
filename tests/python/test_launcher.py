"""smprun end to end: real launchers and ranks on 127.0.0.1, no mocks.

The binary is $SMP_BUILD_DIR/bin/smprun (default <repo>/build); the tests skip only if it is
absent. Every subprocess has a bounded timeout, so a launcher bug fails a test, never hangs
the suite. Scripts run by the ranks live in tests/python/launcher_scripts/.
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PYTHON

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("SMP_BUILD_DIR", REPO / "build"))
SMPRUN = BUILD / "bin" / "smprun"
SCRIPTS = Path(__file__).resolve().parent / "launcher_scripts"
TIMEOUT = 30  # seconds, any single launcher run
TEST_SECRET = "5e" * 32

pytestmark = pytest.mark.skipif(not SMPRUN.exists(), reason=f"{SMPRUN} not built")


def clean_env(**extra):
    """The test's environment without scheduler variables that would change defaults."""
    prefixes = ("SLURM_", "OMPI_", "SM_", "MASTER_", "PMIX_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.pop("SMP_CONFIG", None)
    # Multi-node jobs need a secret every node shares (Note [Job secret]); one node draws
    # its own when none is set (test_security.py).
    env["SMP_JOB_SECRET"] = TEST_SECRET
    env.update(extra)
    return env


def run(args, timeout=TIMEOUT, env=None):
    """Runs smprun to completion; returns (rc, stdout, stderr, seconds)."""
    start = time.monotonic()
    p = subprocess.run([str(SMPRUN), *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env=env or clean_env(), errors="replace")
    return p.returncode, p.stdout, p.stderr, time.monotonic() - start


class Launcher:
    """A background smprun with output in files (no pipe can fill up and block it)."""

    def __init__(self, args, tmp_path, name, env=None):
        self.out_path = tmp_path / f"{name}.out"
        self.err_path = tmp_path / f"{name}.err"
        self.start = time.monotonic()
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([str(SMPRUN), *map(str, args)], stdout=out, stderr=err,
                                         env=env or clean_env(), start_new_session=True)

    def wait(self, timeout=TIMEOUT):
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"smprun did not exit within {timeout} s:\n{self.err}")
        return rc

    @property
    def out(self):
        return self.out_path.read_text(errors="replace")

    @property
    def err(self):
        return self.err_path.read_text(errors="replace")

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def launchers():
    started = []
    yield started
    for launcher in started:
        launcher.kill()


def free_port_pair():
    """A port p such that p and p + 1 (the control port) are both free on 127.0.0.1."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def node_args(node, port, nproc=2, nnodes=2):
    return ["--nnodes", nnodes, "--node_rank", node, "--nproc_per_node", nproc,
            "--master_addr", "127.0.0.1", "--master_port", port]


def read_pids(pid_file):
    if not pid_file.exists():
        return []
    return [int(line.split()[1]) for line in pid_file.read_text().splitlines() if line]


def wait_for_pids(pid_file, n, timeout=15):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(read_pids(pid_file)) >= n:
            return read_pids(pid_file)
        time.sleep(0.02)
    raise AssertionError(f"only {read_pids(pid_file)} of {n} pids recorded")


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def assert_all_dead(pids, timeout=3):
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [p for p in pids if alive(p)], "processes survived the launcher"


def rank_envs(stdout):
    return {int(e["RANK"]): e for e in
            (json.loads(line.split("ENV ", 1)[1]) for line in stdout.splitlines() if "ENV " in line)}


# ---------------------------------------------------------------------------------- one node

def test_single_node_environment_and_arguments():
    rc, out, err, _ = run(["--nproc_per_node", 4, "--config", '{"partitions": 2}',
                           SCRIPTS / "env_dump.py", "--lr", 3, "--nproc_per_node", 9])
    assert rc == 0, err
    envs = rank_envs(out)
    assert sorted(envs) == [0, 1, 2, 3]
    ports = {e["MASTER_PORT"] for e in envs.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0
    threads = str(max(1, len(os.sched_getaffinity(0)) // 4))
    for r, e in envs.items():
        assert e["WORLD_SIZE"] == "4" and e["LOCAL_RANK"] == str(r)
        assert e["LOCAL_WORLD_SIZE"] == "4" and e["NODE_RANK"] == "0"
        assert e["MASTER_ADDR"] == "127.0.0.1" and e["SMP_RESTART_COUNT"] == "0"
        assert json.loads(e["SMP_CONFIG"]) == {"partitions": 2}
        assert e["OMP_NUM_THREADS"] == threads and e["OPENBLAS_NUM_THREADS"] == threads
        assert e["argv"] == ["--lr", "3", "--nproc_per_node", "9"]
    assert "restarts used: 0 of 0" in err


def test_config_file_and_no_config(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text('{"microbatches": 4}')
    rc, out, err, _ = run(["--config", cfg, SCRIPTS / "env_dump.py"])
    assert rc == 0, err
    assert json.loads(rank_envs(out)[0]["SMP_CONFIG"]) == {"microbatches": 4}
    rc, out, err, _ = run([SCRIPTS / "env_dump.py"], env=clean_env(OMP_NUM_THREADS="5"))
    assert rc == 0, err
    assert rank_envs(out)[0]["SMP_CONFIG"] is None
    assert rank_envs(out)[0]["OMP_NUM_THREADS"] == "5"


def test_bind_cores_gives_each_rank_its_own_cpus():
    """Note [Core binding]: disjoint blocks that cover the launcher's CPUs, inherited by
    every thread a rank starts; without the flag every rank may use them all."""
    mine = sorted(os.sched_getaffinity(0))
    n = min(len(mine), 4)
    rc, out, err, _ = run(["--nproc_per_node", n, "--bind_cores", SCRIPTS / "env_dump.py"])
    assert rc == 0, err
    envs = rank_envs(out)
    blocks = [envs[r]["cpus"] for r in range(n)]
    assert sum(blocks, []) == mine, blocks  # in rank order, each CPU once
    assert all(envs[r]["thread_cpus"] == envs[r]["cpus"] for r in range(n))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    rc, out, err, _ = run(["--nproc_per_node", n, SCRIPTS / "env_dump.py"])
    assert rc == 0, err
    assert all(e["cpus"] == mine for e in rank_envs(out).values())
    # More ranks than CPUs: refused at once, naming the flag and the values allowed.
    rc, out, err, _ = run(["--nproc_per_node", len(mine) + 1, "--bind-cores",
                           SCRIPTS / "env_dump.py"], timeout=10)
    assert rc == 2 and out == ""
    assert err.strip() == (f"smprun: error: --bind_cores needs a CPU per rank: --nproc_per_node "
                           f"{len(mine) + 1} ranks, but smprun may use {len(mine)} CPUs "
                           f"(allowed: --nproc_per_node <= {len(mine)}, or no --bind_cores)"), err


def test_output_lines_are_prefixed_and_whole():
    count, width = 150, 3000
    rc, out, err, _ = run(["--nproc_per_node", 4, SCRIPTS / "long_lines.py", count, width])
    assert rc == 0, err[-2000:]
    pattern = re.compile(r"^\[(\d)\] r(\d) (out|err) (\d+) ([a-d]+)$")
    for stream, text in (("out", out), ("err", err)):
        lines = [l for l in text.splitlines() if not l.startswith("smprun:")]
        assert len(lines) == 4 * count
        seen = set()
        for line in lines:
            m = pattern.match(line)
            assert m, f"broken line: {line[:80]}...{line[-20:]}"
            rank = int(m[1])
            assert int(m[2]) == rank and m[3] == stream
            assert m[5] == chr(ord("a") + rank) * width
            seen.add((rank, int(m[4])))
        assert len(seen) == 4 * count


def test_log_dir_with_and_without_tee(tmp_path):
    logs = tmp_path / "logs"
    rc, out, err, _ = run(["--nproc_per_node", 2, "--log_dir", logs, SCRIPTS / "long_lines.py",
                           3, 10])
    assert rc == 0, err
    assert "[0]" not in out and "[1]" not in err  # console gets no rank output
    text = (logs / "rank_1.log").read_text().splitlines()
    assert sorted(text) == sorted([f"r1 {s} {i} " + "b" * 10 for i in range(3)
                                   for s in ("out", "err")])
    rc, out, err, _ = run(["--nproc_per_node", 2, "--log_dir", logs, "--tee",
                           SCRIPTS / "long_lines.py", 2, 10])
    assert rc == 0, err
    assert "[1] r1 out 1 " + "b" * 10 in out.splitlines()
    assert len((logs / "rank_0.log").read_text().splitlines()) == 4  # truncated per job


def test_rank_failure_stops_every_rank(tmp_path):
    pids = tmp_path / "pids"
    rc, out, err, elapsed = run(["--nproc_per_node", 4, "--grace_period", 1,
                                 SCRIPTS / "rank_job.py", pids, "--fail-rank", 2, "--code", 7,
                                 "--wait-ranks", 5])
    assert rc == 1, err
    assert elapsed < 15
    assert "rank 2 (node 0, local rank 2) exited with code 7 -- failed first" in err
    assert "last 20 lines of rank 2's output:" in err
    assert "[2] rank 2 progress line 29" in err.split("failed first")[1]
    assert re.search(r"\[2\] FAILING_AT [\d.]+\n", err.split("failed first")[1])
    assert "job failed: rank 2" in err
    recorded = read_pids(pids)
    assert len(recorded) == 5  # four ranks and rank 0's grandchild
    assert_all_dead(recorded)


def test_rank_killed_by_signal_is_named(tmp_path):
    pids = tmp_path / "pids"
    rc, out, err, elapsed = run(["--nproc_per_node", 3, SCRIPTS / "rank_job.py", pids,
                                 "--kill-rank", 1, "--wait-ranks", 4])
    assert rc == 1, err
    assert "rank 1 (node 0, local rank 1) was killed by signal SIGKILL" in err
    assert "[1] about to be killed" in err
    assert_all_dead(read_pids(pids))


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_launcher_stops_everything(tmp_path, launchers, sig, code):
    pids = tmp_path / "pids"
    launcher = Launcher(["--nproc_per_node", 3, SCRIPTS / "rank_job.py", pids], tmp_path, "l")
    launchers.append(launcher)
    recorded = wait_for_pids(pids, 4)
    launcher.proc.send_signal(sig)
    assert launcher.wait(timeout=15) == code, launcher.err
    assert f"received {signal.Signals(sig).name}" in launcher.err
    assert_all_dead(recorded)


def test_restart_after_failure_succeeds():
    rc, out, err, _ = run(["--nproc_per_node", 2, "--max_restarts", 1,
                           SCRIPTS / "restart_job.py", 1])
    assert rc == 0, err
    assert "[1] rank 1 attempt 0" in out and "[1] rank 1 attempt 1" in out
    assert "rank 1 (node 0, local rank 1) exited with code 3" in err
    assert "restarting the job (restart 1 of 1)" in err
    assert "job succeeded: all 2 ranks exited 0 (restarts used: 1 of 1)" in err


def test_restarts_exhausted():
    rc, out, err, _ = run(["--nproc_per_node", 2, "--max_restarts", 1,
                           SCRIPTS / "restart_job.py", 5])
    assert rc == 1, err
    assert "job failed: rank 1 (node 0, local rank 1) exited with code 3 (restarts used: 1 of 1)" \
        in err


# ------------------------------------------------------------------------------- bad input

def _busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("args,message", [
    (["--bogus", "x.py"], "unknown option '--bogus'"),
    ([], "missing PROGRAM"),
    (["--nproc_per_node", 0, SCRIPTS / "env_dump.py"], "--nproc_per_node must be >= 1, got 0"),
    (["--nnodes", 2, "--node_rank", 2, "--master_addr", "127.0.0.1", SCRIPTS / "env_dump.py"],
     "--node_rank 2 is not in [0, 2)"),
    ([SCRIPTS / "__init__missing.py"], "not found"),
    (["NOEXEC"], "is not executable (and not a .py script)"),
    (["--config", "{nope", SCRIPTS / "env_dump.py"], "not an existing file nor valid JSON"),
    (["--master_port", "BUSY", SCRIPTS / "env_dump.py"], "in use"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, message):
    noexec = tmp_path / "data.txt"
    noexec.write_text("not a program\n")
    busy = _busy_port()
    try:
        subst = {"BUSY": busy.getsockname()[1], "NOEXEC": noexec}
        args = [subst.get(a, a) if isinstance(a, str) else a for a in args]
        rc, out, err, elapsed = run(args, timeout=10)
    finally:
        busy.close()
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("smprun: error: "), err
    assert message in lines[0]
    assert out == ""


def test_help_explains_every_flag():
    rc, out, err, _ = run(["--help"], timeout=10)
    assert rc == 0
    for flag in ("--nnodes", "--node_rank", "--nproc_per_node", "--master_addr",
                 "--master_port", "--config", "--log_dir", "--tee", "--max_restarts",
                 "--rdzv_timeout", "--grace_period", "--bind_cores", "PROGRAM [ARGS...]"):
        assert flag in out


# ------------------------------------------------------------------------------- two nodes

def test_two_nodes_form_one_world(tmp_path, launchers):
    port = free_port_pair()
    n1 = Launcher(node_args(1, port) + [SCRIPTS / "env_dump.py"], tmp_path, "n1")
    launchers.append(n1)
    rc, out, err, _ = run(node_args(0, port) + [SCRIPTS / "env_dump.py"])
    assert rc == 0, err
    assert n1.wait() == 0, n1.err
    envs = rank_envs(out) | rank_envs(n1.out)
    assert sorted(envs) == [0, 1, 2, 3]
    for r, e in envs.items():
        assert e["WORLD_SIZE"] == "4" and e["LOCAL_WORLD_SIZE"] == "2"
        assert e["NODE_RANK"] == str(r // 2) and e["LOCAL_RANK"] == str(r % 2)
        assert e["MASTER_ADDR"] == "127.0.0.1" and e["MASTER_PORT"] == str(port)
    assert sorted(rank_envs(n1.out)) == [2, 3]
    assert "job succeeded: all 4 ranks exited 0" in n1.err


def test_two_nodes_torch_allreduce_through_smp_init(tmp_path, launchers):
    if not (BUILD / "python" / "smp" / "__init__.py").exists():
        pytest.skip(f"no smp package in {BUILD / 'python'} (a launcher-only build)")
    port = free_port_pair()
    # The ranks run on the suite's interpreter, whose torch the build used (was
    # /usr/bin/python3's torch 1.13, which cannot import a 2.x build: a silent skip).
    env = clean_env(PYTHONPATH=str(BUILD / "python"), SMP_PYTHON=PYTHON)
    n1 = Launcher(node_args(1, port) + [SCRIPTS / "allreduce.py"], tmp_path, "n1", env=env)
    launchers.append(n1)
    rc, out, err, _ = run(node_args(0, port) + [SCRIPTS / "allreduce.py"], timeout=90, env=env)
    assert rc == 0, err[-3000:]
    assert n1.wait(timeout=30) == 0, n1.err[-3000:]
    lines = [l for l in (out + n1.out).splitlines() if "ALLREDUCE" in l]
    assert sorted(lines) == sorted(f"[{r}] ALLREDUCE rank={r} world=4 sum=6" for r in range(4))


def test_failure_on_node_1_stops_node_0(tmp_path, launchers):
    port = free_port_pair()
    pids = tmp_path / "pids"
    job = [SCRIPTS / "rank_job.py", pids, "--fail-rank", 3, "--code", 5, "--wait-ranks", 5]
    n1 = Launcher(node_args(1, port) + ["--grace_period", 1] + job, tmp_path, "n1")
    launchers.append(n1)
    rc, out, err, elapsed = run(node_args(0, port) + ["--grace_period", 1] + job)
    assert rc == 1, err
    assert elapsed < 15
    assert n1.wait() == 1, n1.err
    for text in (err, n1.err):
        assert "rank 3 (node 1, local rank 1) exited with code 5 -- failed first" in text
        assert "[3] rank 3 progress line 29" in text
    assert_all_dead(read_pids(pids))


def test_restart_across_two_nodes(tmp_path, launchers):
    port = free_port_pair()
    job = ["--max_restarts", 2, SCRIPTS / "restart_job.py", 1]
    n1 = Launcher(node_args(1, port, nproc=1) + job, tmp_path, "n1")
    launchers.append(n1)
    rc, out, err, _ = run(node_args(0, port, nproc=1) + job)
    assert rc == 0, err
    assert n1.wait() == 0, n1.err
    assert "[1] rank 1 attempt 1" in n1.out and "[0] rank 0 attempt 1" in out
    for text in (err, n1.err):
        assert "rank 1 (node 1, local rank 0) exited with code 3" in text
        assert "restarts used: 1 of 2" in text


def test_killed_node_1_launcher_fails_node_0(tmp_path, launchers):
    port = free_port_pair()
    pids = tmp_path / "pids"
    job = [SCRIPTS / "rank_job.py", pids]
    n0 = Launcher(node_args(0, port) + ["--grace_period", 1] + job, tmp_path, "n0")
    n1 = Launcher(node_args(1, port) + job, tmp_path, "n1")
    launchers.extend([n0, n1])
    recorded = wait_for_pids(pids, 5)
    n1.proc.send_signal(signal.SIGKILL)
    n1.proc.wait()
    assert n0.wait(timeout=15) == 1, n0.err
    assert "the launcher of node 1 was lost (connection closed)" in n0.err
    assert_all_dead(recorded)  # node 1's ranks die by PR_SET_PDEATHSIG


def test_silent_node_is_lost_after_heartbeat_timeout(tmp_path, launchers):
    port = free_port_pair()
    pids = tmp_path / "pids"
    job = ["--heartbeat_timeout", 1.5, "--grace_period", 1, SCRIPTS / "rank_job.py", pids]
    n0 = Launcher(node_args(0, port) + job, tmp_path, "n0")
    n1 = Launcher(node_args(1, port) + job, tmp_path, "n1")
    launchers.extend([n0, n1])
    recorded = wait_for_pids(pids, 5)
    n1.proc.send_signal(signal.SIGSTOP)
    try:
        assert n0.wait(timeout=15) == 1, n0.err
    finally:
        n1.proc.send_signal(signal.SIGCONT)
    assert "the launcher of node 1 was lost (no heartbeat for 1.5 s)" in n0.err
    assert n1.wait(timeout=15) == 1, n1.err  # resumed: finds node 0 gone, stops its ranks
    assert "lost the coordinator (node 0)" in n1.err
    assert_all_dead(recorded)


# Note [Rejoining after a lost node]: with a restart left, node 0 waits for a lost node
# to join again (here a new launcher, as after a host's reboot) and restarts the job.
def test_lost_node_joins_again_under_max_restarts(tmp_path, launchers):
    port = free_port_pair()
    pids = tmp_path / "pids"
    job = ["--max_restarts", 1, "--grace_period", 1, SCRIPTS / "rejoin_job.py", pids]
    n0 = Launcher(node_args(0, port) + job, tmp_path, "n0")
    n1 = Launcher(node_args(1, port) + job, tmp_path, "n1")
    launchers.extend([n0, n1])
    recorded = wait_for_pids(pids, 4)
    n1.proc.send_signal(signal.SIGKILL)
    n1.proc.wait()
    deadline = time.monotonic() + 15
    while "to join again" not in n0.err and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "waiting for node ranks 1 to join again before restart 1 of 1" in n0.err, n0.err
    again = Launcher(node_args(1, port) + job, tmp_path, "again")
    launchers.append(again)
    assert n0.wait(timeout=30) == 0, n0.err
    assert again.wait(timeout=15) == 0, again.err
    assert "the launcher of node 1 was lost (connection closed)" in n0.err
    assert "restarts used: 1 of 1" in n0.err and "restarts used: 1 of 1" in again.err
    assert "[2] rank 2 attempt 1" in again.out and "[0] rank 0 attempt 1" in n0.out
    assert_all_dead(recorded)


@pytest.mark.parametrize("target", [0, 1])
def test_sigterm_to_either_node_stops_the_job(tmp_path, launchers, target):
    port = free_port_pair()
    pids = tmp_path / "pids"
    job = [SCRIPTS / "rank_job.py", pids]
    nodes = [Launcher(node_args(n, port) + job, tmp_path, f"n{n}") for n in (0, 1)]
    launchers.extend(nodes)
    recorded = wait_for_pids(pids, 5)
    nodes[target].proc.send_signal(signal.SIGTERM)
    for node in nodes:
        assert node.wait(timeout=15) == 143, node.err
        assert f"the launcher of node {target} received SIGTERM" in node.err
    assert_all_dead(recorded)


def test_mismatched_nodes_fail_on_both(tmp_path, launchers):
    port = free_port_pair()
    n1 = Launcher(node_args(1, port, nproc=3) + [SCRIPTS / "env_dump.py"], tmp_path, "n1")
    launchers.append(n1)
    rc, out, err, _ = run(node_args(0, port, nproc=2) + [SCRIPTS / "env_dump.py"])
    message = "node 1 has --nproc_per_node 3 but node 0 has 2"
    assert rc == 2 and message in err, err
    assert n1.wait() == 2 and message in n1.err, n1.err
    assert "ENV" not in out + n1.out


def test_mismatched_max_restarts_fail_on_both(tmp_path, launchers):
    # A node decides alone whether to join again after losing node 0: the counts must agree.
    port = free_port_pair()
    n1 = Launcher(node_args(1, port) + ["--max_restarts", 1, SCRIPTS / "env_dump.py"], tmp_path,
                  "n1")
    launchers.append(n1)
    rc, out, err, _ = run(node_args(0, port) + [SCRIPTS / "env_dump.py"])
    message = "node 1 has --max_restarts 1 but node 0 has 0"
    assert rc == 2 and message in err, err
    assert n1.wait() == 2 and message in n1.err, n1.err


def test_coordinator_that_never_appears_is_named():
    port = free_port_pair()
    rc, out, err, elapsed = run(node_args(1, port) + ["--rdzv_timeout", 1,
                                                      SCRIPTS / "env_dump.py"], timeout=15)
    assert rc == 1, err
    assert elapsed < 10
    assert f"cannot reach the coordinator (node 0) at 127.0.0.1:{port + 1} within 1 s" in err
