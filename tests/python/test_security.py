"""A job no stranger can enter (Note [Job secret], docs/security.md): real launchers and
ranks on 127.0.0.1, and strangers that are processes (sockets) of this test, not of the job.

Each stranger connects where a job listens or writes where it reads: the launchers'
control port, and the c10d store. It sends garbage, a well-formed handshake under another
secret, or a forged value. Each must be refused and logged, the job's result must be
unchanged, and nothing may hang. The pipeline mesh's refusals, a replayed handshake among
them, are tested in tests/cpp/smp_core/tcp_mesh_test.cpp with the same handshake.
"""
import hashlib
import hmac
import json
import os
import socket
import time

import pytest

from conftest import PYTHON
from test_launcher import (BUILD, SCRIPTS, SMPRUN, TEST_SECRET, Launcher, clean_env,
                           free_port_pair, launchers, node_args, rank_envs, run)  # noqa: F401

pytestmark = pytest.mark.skipif(not SMPRUN.exists(), reason=f"{SMPRUN} not built")


def job_key(secret_hex):
    return hashlib.sha256(bytes.fromhex(secret_hex)).digest()


def mac(key, label, data):
    return hmac.new(key, label.encode() + b"\0" + data, hashlib.sha256).digest()


def stranger_handshake(port, secret_hex, label="control", context=b"smp-control"):
    """Speaks smp's handshake as an initiator under `secret_hex`; returns how it ended."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        nonce_i = os.urandom(16)
        s.sendall(b"SMPA" + nonce_i)
        reply = b""
        while len(reply) < 48:
            chunk = s.recv(48 - len(reply))
            if not chunk:
                return "closed before the challenge"
            reply += chunk
        nonce_r, their_proof = reply[:16], reply[16:]
        transcript = context + b"\0" + nonce_i + nonce_r
        if hmac.compare_digest(their_proof, mac(job_key(secret_hex), label + "/responder",
                                                transcript)):
            return "node 0 proved our key"  # must never happen with another secret
        # Send a proof anyway (under our key), as a stranger that does not check would.
        s.sendall(mac(job_key(secret_hex), label + "/initiator", transcript))
        return "closed" if closed_by_peer(s) else "accepted"


def closed_by_peer(s):
    """True once the other end closed `s` (a reset, when our bytes went unread)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def wait_listening(port, timeout=15):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            # A bare connect is itself a stranger the coordinator must survive.
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}")


def test_control_channel_refuses_strangers_and_the_job_runs(tmp_path, launchers):
    port = free_port_pair()
    n0 = Launcher(node_args(0, port) + [SCRIPTS / "env_dump.py"], tmp_path, "n0")
    launchers.append(n0)
    wait_listening(port + 1)
    # Garbage, then a well-formed handshake under another secret.
    with socket.create_connection(("127.0.0.1", port + 1), timeout=5) as s:
        s.sendall(b'{"t": "hello", "v": 1, "job": "smp", "nnodes": 2, "nproc": 2, "node": 1}\n')
        assert closed_by_peer(s)  # nothing answered
    assert stranger_handshake(port + 1, "ab" * 32) == "closed"
    n1 = Launcher(node_args(1, port) + [SCRIPTS / "env_dump.py"], tmp_path, "n1")
    launchers.append(n1)
    assert n0.wait() == 0, n0.err
    assert n1.wait() == 0, n1.err
    assert sorted(rank_envs(n0.out) | rank_envs(n1.out)) == [0, 1, 2, 3]
    assert "refused a control connection from 127.0.0.1: not an smp handshake" in n0.err
    assert "refused a control connection from 127.0.0.1: the peer did not prove this job's secret" \
        in n0.err, n0.err
    assert "job succeeded: all 4 ranks exited 0" in n0.err


def test_a_node_with_another_secret_is_refused_and_named(tmp_path, launchers):
    port = free_port_pair()
    n0 = Launcher(node_args(0, port) + ["--rdzv_timeout", 3, SCRIPTS / "env_dump.py"], tmp_path,
                  "n0")
    launchers.append(n0)
    wait_listening(port + 1)
    rc, out, err, _ = run(node_args(1, port) + [SCRIPTS / "env_dump.py"],
                                env=clean_env(SMP_JOB_SECRET="cd" * 32))
    assert rc == 1, err  # (run() bounds it: no hang)
    assert "node 0 at 127.0.0.1:" in err and "failed authentication" in err, err
    assert "same SMP_JOB_SECRET or --secret_file" in err
    assert n0.wait() == 1
    assert "refused a control connection from 127.0.0.1" in n0.err
    assert "ENV" not in out + n0.out


def test_one_node_draws_a_secret_per_job_for_its_ranks():
    env = clean_env()
    del env["SMP_JOB_SECRET"]
    secrets = []
    for _ in range(2):
        rc, out, err, _ = run(["--nproc_per_node", 2, SCRIPTS / "env_dump.py"], env=env)
        assert rc == 0, err
        job = {e["SMP_JOB_SECRET"] for e in rank_envs(out).values()}
        assert len(job) == 1  # every rank of a job holds the same one
        secrets.append(job.pop())
    assert secrets[0] != secrets[1] and all(len(s) == 64 for s in secrets)


FORGERY = r"""
import os, pickle, sys
import smp
from smp.process_state import state  # the job's c10d store, as a stranger reaches it

smp.init({})
marker = sys.argv[1]
if smp.rank() == 0:
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    # A stranger with access to the store puts a pickle where rank 1's next message
    # from rank 0 will be read (smp/p2p/<src>/<dst>/<seq>), without the job's key.
    state.store.set("smp/p2p/0/1/0", pickle.dumps(Payload()))
    smp.barrier()
else:
    smp.barrier()
    try:
        smp.recv_from(0)
        print("UNPICKLED", flush=True)
    except Exception as e:  # the job's result: a named error, not the stranger's code
        print("REFUSED", type(e).__name__, str(e).splitlines()[0], flush=True)
smp.barrier()
"""


def test_a_forged_store_value_is_refused_before_it_is_unpickled(tmp_path):
    if not (BUILD / "python" / "smp" / "__init__.py").exists():
        pytest.skip(f"no smp package in {BUILD / 'python'}")
    script = tmp_path / "forge.py"
    script.write_text(FORGERY)
    marker = tmp_path / "pwned"
    env = clean_env(PYTHONPATH=str(BUILD / "python"), SMP_PYTHON=PYTHON)
    rc, out, err, _ = run(["--nproc_per_node", 2, script, marker], timeout=90, env=env)
    assert rc == 0, err[-3000:]
    assert not marker.exists(), "the forged pickle ran"
    assert "UNPICKLED" not in out
    assert "REFUSED" in out and "'smp/p2p/0/1/0' failed authentication" in out, out


DIFFERENT_SECRETS = """
import os, sys
os.environ["SMP_JOB_SECRET"] = ("cd" if os.environ["RANK"] == "2" else "ab") * 32
import smp
try:
    smp.init({"timeout_s": 20})
    print("JOINED", flush=True)
except smp.CommError as e:
    print("REFUSED", type(e).__name__, str(e).splitlines()[0], flush=True)
    sys.exit(3)
"""


def test_ranks_whose_secrets_differ_all_fail_naming_them(ranks):
    """A secret that differs between nodes is a mismatch between ranks: reported on every
    rank, before any collective, naming the ranks (Note [Job secret])."""
    res = ranks(DIFFERENT_SECRETS, 3, check=False, timeout=60)
    for r, p in enumerate(res):
        assert p.returncode == 3, p
        assert "JOINED" not in p.stdout
        who = "0,1" if r == 2 else "2"
        assert (f"the config of every rank (smp.init) from rank(s) {who} failed authentication "
                f"on rank {r}") in p.stdout, p.stdout


NO_SECRET = """
import os
os.environ.pop("SMP_JOB_SECRET", None)
import smp
smp.init({})
if smp.rank() == 0:
    smp.send(["from rank 0"], 1)
    print("OBJ", ["from rank 0"], flush=True)
else:
    print("OBJ", smp.recv_from(0), flush=True)
smp.barrier()
"""


@pytest.mark.parametrize("hosts", [1, 2])
def test_without_a_secret_the_store_carries_one_and_rank_0_says_so(ranks, hosts):
    """torchrun and srun set no SMP_JOB_SECRET: rank 0 draws the key and says how weak
    that is: a warning when the job spans hosts (here, LOCAL_WORLD_SIZE 1 of 2), else a
    DEBUG line (SMP_LOG_LEVEL=DEBUG shows it); the job runs."""
    env = {"LOCAL_WORLD_SIZE": "1"} if hosts == 2 else {"SMP_LOG_LEVEL": "DEBUG"}
    per_rank = (lambda r: {"LOCAL_RANK": 0}) if hosts == 2 else None
    res = ranks(NO_SECRET, 2, timeout=60, env=env, per_rank_env=per_rank)
    assert "no SMP_JOB_SECRET" in res[0].stderr, res[0].stderr
    assert "no SMP_JOB_SECRET" not in res[1].stderr
    assert all("OBJ ['from rank 0']" in p.stdout for p in res), res
    quiet = ranks(NO_SECRET, 2, timeout=60)  # one host, default level: not a warning
    assert "no SMP_JOB_SECRET" not in quiet[0].stderr
