"""smp.init under launchers other than smprun: torchrun (agent store, c10d rendezvous,
restarts), srun and mpirun started directly (SLURM_* / OMPI_COMM_WORLD_*), and the
errors and versions users meet there. Real processes throughout."""
import os
import subprocess
import textwrap

import pytest

from conftest import BUILD, PYTHON, REPO, free_port
from torch_peer import TORCHRUN_C10D_RDZV_USES_AGENT_STORE

# Variables a launcher sets: none leaks into a case from the test's own environment.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                  "MASTER_PORT", "SMP_CONFIG", "SM_HP_MP_PARAMETERS", "GROUP_RANK")
_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "TORCHELASTIC_", "PMI_")

# Two ranks, ddp: each trains on its half of every batch; the plain module trains on the
# whole batch in the same process. Replicas must end equal to each other (bitwise) and
# to the plain module; then smp is shut down and initialised again. On attempt 0 of a
# restarted run, rank 1 fails after one step.
TRAIN = r"""
import copy, os, sys
import torch, torch.nn as nn
import smp

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
smp.init({"ddp": True, "timeout_s": 60, "microbatches": 1 + attempt})
assert (smp.size(), smp.dp_size(), smp.local_size()) == (2, 2, 2), smp.state.topology
assert smp.local_rank() == smp.rank(), (smp.local_rank(), smp.rank())
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
ref = copy.deepcopy(net)
opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
model = smp.DistributedModel(net)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

gen = torch.Generator().manual_seed(7)
for step in range(3):
    x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
    mine = slice(4 * smp.dp_rank(), 4 * smp.dp_rank() + 4)
    train_step(x[mine], y[mine])
    opt.step(); opt.zero_grad()
    nn.functional.mse_loss(ref(x), y).backward()
    ref_opt.step(); ref_opt.zero_grad()
    if attempt == 0 and "FAIL_ONCE" in os.environ and smp.rank() == 1:
        sys.exit(3)
mine = [p.detach().clone() for p in net.parameters()]
for other in smp.allgather(mine):
    for a, b in zip(mine, other):
        assert torch.equal(a, b), "replicas differ"
for (name, p), q in zip(net.named_parameters(), ref.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
# Initialising again in the same processes meets none of the first init's keys.
smp.shutdown()
smp.init({"timeout_s": 60, "microbatches": 3})
assert smp.allgather(smp.rank()) == [0, 1]
print(f"ok rank {smp.rank()} attempt {attempt} {os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}",
      flush=True)
"""


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_PREFIXES)}
    env.update({
        "PYTHONPATH": os.pathsep.join([os.path.join(BUILD, "python"),
                                       os.path.join(REPO, "tests", "python")]),
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
    })
    env.update({k: str(v) for k, v in extra.items()})
    return env


def write(tmp_path, text, name="train.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def torchrun(tmp_path, *flags, env=None, timeout=180):
    script = write(tmp_path, TRAIN)
    cmd = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           # torch 1.13's torchrun on Python 3.11 starts only with these (FACTS.md).
           "--redirects", "1", "--tee", "1", "--monitor_interval", "0.5",
           "--log_dir", str(tmp_path / "logs"), *map(str, flags), script]
    out = subprocess.run(cmd, env=clean_env(**(env or {})), cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=timeout)
    return out


def oks(text):
    """The ranks' final lines, from torchrun's "[default<r>]:<line>" console copies."""
    lines = (line.split(":", 1) for line in text.splitlines() if line.startswith("[default"))
    return sorted(rest.strip() for _, rest in lines if rest.startswith("ok rank "))


def test_torchrun_agent_store(tmp_path):
    out = torchrun(tmp_path, "--master_port", free_port())
    assert out.returncode == 0, out.stdout + out.stderr
    assert oks(out.stdout) == ["ok rank 0 attempt 0 True", "ok rank 1 attempt 0 True"], out.stdout


def test_torchrun_c10d_rendezvous(tmp_path):
    # Whether the workers share the agent's store is torchrun's choice (torch_peer.py):
    # both ranks must see the same.
    out = torchrun(tmp_path, "--rdzv_backend", "c10d", "--rdzv_endpoint",
                   f"127.0.0.1:{free_port()}")
    assert out.returncode == 0, out.stdout + out.stderr
    flag = str(TORCHRUN_C10D_RDZV_USES_AGENT_STORE)
    assert oks(out.stdout) == [f"ok rank 0 attempt 0 {flag}", f"ok rank 1 attempt 0 {flag}"], \
        out.stdout


def test_torchrun_restart_gets_a_fresh_store(tmp_path):
    """Attempt 0 initialises (its init keys stay on the agent's store) and rank 1 fails;
    attempt 1 uses another config (microbatches 2). Reading attempt 0's keys shows as
    "config 'microbatches' differs across ranks" or a stale Gloo address (seen with the
    agent's store used unprefixed); with per-attempt keys it trains correctly."""
    out = torchrun(tmp_path, "--master_port", free_port(), "--max_restarts", "1",
                   env={"FAIL_ONCE": 1})
    assert out.returncode == 0, out.stdout + out.stderr
    assert oks(out.stdout) == ["ok rank 0 attempt 1 True", "ok rank 1 attempt 1 True"], out.stdout


def spawn(tmp_path, script, envs, timeout=120):
    """Starts one process per env dict, as srun or mpirun would; returns (rc, out, err)s."""
    path = write(tmp_path, script, f"script_{len(envs)}_{free_port()}.py")
    procs = [subprocess.Popen([PYTHON, path], env=clean_env(**e), cwd=str(tmp_path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for e in envs]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    return results


def test_srun_environment_builds_the_world(tmp_path):
    port = free_port()
    envs = [dict(SLURM_PROCID=r, SLURM_NTASKS=2, SLURM_LOCALID=r, SLURM_NODEID=0,
                 SLURM_NNODES=1, SLURM_TASKS_PER_NODE=2, SLURM_JOB_ID=77, SLURM_STEP_ID=0,
                 SLURM_JOB_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            for r in range(2)]
    for rc, out, err in spawn(tmp_path, TRAIN, envs):
        assert rc == 0, out + err
        assert "ok rank" in out


def test_mpirun_environment_builds_the_world(tmp_path):
    port = free_port()
    script = """
    import os, torch, torch.distributed as dist, smp
    smp.init({"ddp": True, "timeout_s": 60})
    assert (smp.rank(), smp.size()) == (int(os.environ["OMPI_COMM_WORLD_RANK"]), 2)
    assert (smp.local_rank(), smp.local_size()) == (smp.rank(), 2)
    # Derived endpoint exported as torchrun and smprun export theirs.
    assert os.environ["MASTER_ADDR"] == "127.0.0.1", os.environ["MASTER_ADDR"]
    t = torch.tensor([smp.rank() + 1.0])
    dist.all_reduce(t, group=smp.get_world_process_group())
    assert smp.allgather(smp.rank()) == [0, 1] and t.item() == 3.0
    print("ok")
    """
    # Inherited SLURM variables of the batch step lose to mpirun's own.
    envs = [dict(OMPI_COMM_WORLD_RANK=r, OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_LOCAL_RANK=r,
                 OMPI_COMM_WORLD_LOCAL_SIZE=2, OMPI_MCA_ess_base_jobid=5, MASTER_PORT=port,
                 SLURM_PROCID=0, SLURM_NTASKS=4, SLURM_LOCALID=0) for r in range(2)]
    for rc, out, err in spawn(tmp_path, script, envs):
        assert rc == 0 and out.strip() == "ok", out + err


ERROR_SCRIPT = """
import smp
try:
    smp.init({"ddp": True})
except smp.ConfigError as e:
    print(e)
else:
    print("no error", smp.size())
"""


@pytest.mark.parametrize("env,message", [
    (dict(OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=4, OMPI_COMM_WORLD_LOCAL_RANK=0,
          OMPI_COMM_WORLD_LOCAL_SIZE=2),
     "smp: environment MASTER_ADDR is not set, and mpirun started 4 ranks on several nodes "
     "(OMPI_COMM_WORLD_SIZE=4, OMPI_COMM_WORLD_LOCAL_SIZE=2); Open MPI does not name rank "
     "0's host: set MASTER_ADDR (mpirun -x MASTER_ADDR=<host of rank 0>)"),
    (dict(SLURM_PROCID=1, SLURM_LOCALID=1),
     "smp: environment SLURM_NTASKS is not set, but SLURM_PROCID=1 is (a script started by "
     "srun needs SLURM_NTASKS and SLURM_LOCALID)"),
    (dict(OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_LOCAL_SIZE=2),
     "smp: environment OMPI_COMM_WORLD_LOCAL_RANK is not set, but OMPI_COMM_WORLD_RANK=1 is "
     "(a script started by mpirun needs OMPI_COMM_WORLD_SIZE, _LOCAL_RANK and _LOCAL_SIZE)"),
    (dict(RANK=1, WORLD_SIZE=2),
     "smp: environment MASTER_PORT is not set (RANK=1, WORLD_SIZE=2); set MASTER_ADDR and "
     "MASTER_PORT to rank 0's host and a free port, or launch with smprun or torchrun"),
])
def test_missing_launcher_variable_is_named(tmp_path, env, message):
    [(rc, out, err)] = spawn(tmp_path, ERROR_SCRIPT, [env], timeout=60)
    assert rc == 0, err
    assert out.strip() == message


def test_busy_port_is_named(tmp_path):
    """Rank 0 of an srun job cannot host the store on a port another program holds."""
    import socket
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        port = held.getsockname()[1]
        [(rc, out, err)] = spawn(tmp_path, ERROR_SCRIPT, [dict(
            SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_LOCALID=0, SLURM_NNODES=1, MASTER_PORT=port)],
            timeout=60)
    assert rc == 0, err
    assert out.startswith(f"smp: rank 0 cannot host the store on port {port} ("), out
    assert out.strip().endswith("another job or a launcher's own store holds it: set "
                                "MASTER_PORT to a free port"), out


def test_slurm_and_mpi_worlds_of_one_need_nothing_else(tmp_path):
    script = ERROR_SCRIPT + "print(smp.rank(), smp.local_size())\n"
    for env in (dict(SLURM_PROCID=0, SLURM_NTASKS=1, SLURM_LOCALID=0),
                dict(OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=1,
                     OMPI_COMM_WORLD_LOCAL_RANK=0, OMPI_COMM_WORLD_LOCAL_SIZE=1)):
        [(rc, out, err)] = spawn(tmp_path, script, [env], timeout=60)
        assert rc == 0 and out.split() == ["no", "error", "1", "0", "1"], out + err


def test_slurm_rank0_host_follows_smprun_rules():
    """Several nodes: rank 0's host is the first host of the step's nodelist (smprun's
    first_slurm_host), the port smprun's several-node default; tasks per node from
    SLURM's compressed counts."""
    from smp import launch_env
    base = dict(SLURM_PROCID="5", SLURM_NTASKS="7", SLURM_LOCALID="1", SLURM_NNODES="3",
                SLURM_NODEID="2", SLURM_STEP_TASKS_PER_NODE="3(x2),1", SLURM_JOB_ID="9",
                SLURM_STEP_ID="4")
    for nodelist, host in (("node[01-04,07],gpu5", "node01"), ("n[098-101]", "n098"),
                           ("rack[1-2]-n[1,3]", "rack1-n1"), ("gpu5,node[1-2]", "gpu5")):
        w = launch_env.from_environment(dict(base, SLURM_JOB_NODELIST=nodelist))
        assert (w.rank, w.world_size, w.local_rank, w.local_size) == (5, 7, 1, 1)
        assert (w.master_addr, w.master_port, w.key_prefix) == (host, 29500, "smp/slurm/9.4/")
    w = launch_env.from_environment(dict(base, SLURM_NODEID="0", SLURM_JOB_NODELIST="a[1-3]",
                                         MASTER_ADDR="b", MASTER_PORT="1234"))
    assert (w.local_size, w.master_addr, w.master_port) == (3, "b", 1234)
    with pytest.raises(ValueError, match=r"cannot parse SLURM_JOB_NODELIST='a\[1-' "):
        launch_env.from_environment(dict(base, SLURM_JOB_NODELIST="a[1-"))


def test_versions():
    """Hugging Face compares smdistributed.modelparallel.__version__ with 1.10 to take
    its SMP 1.10 paths; smp.__version__ is smp's own."""
    out = subprocess.run([PYTHON, "-c", textwrap.dedent("""
        from packaging import version
        import smdistributed.modelparallel.torch as smp
        from smdistributed.modelparallel import __version__ as SMP_VERSION
        print(version.parse(SMP_VERSION) >= version.parse("1.10"), SMP_VERSION,
              smp.__version__ != SMP_VERSION, smp.SMP_API_VERSION == SMP_VERSION,
              smp.state.module_manager.translate_functions)
        """)], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "1.10.0", "True", "True", "[]"], out.stderr


def test_missing_config_file_messages(tmp_path):
    missing = str(tmp_path / "nope.json")
    out = subprocess.run([PYTHON, "-c", f"import smp\ntry: smp.init({missing!r})\n"
                          "except smp.ConfigError as e: print(e)"],
                         env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == (
        f"smp: config file '{missing}' does not exist (accepted: a dict, the path of an "
        'existing JSON file holding an object like {"partitions": 2}, or None for env '
        "SMP_CONFIG)"), out.stderr
    out = subprocess.run([PYTHON, "-c", "import smp\ntry: smp.init()\n"
                          "except smp.ConfigError as e: print(e)"],
                         env=clean_env(SMP_CONFIG=missing), capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == (
        f"smp: environment SMP_CONFIG='{missing}' is not JSON; SMP_CONFIG holds the JSON "
        'object itself, like {"partitions": 2} (smprun --config and smp.init(config=path) '
        "read a file)"), out.stderr
    smprun = os.path.join(BUILD, "bin", "smprun")
    out = subprocess.run([smprun, "--config", missing, write(tmp_path, "print(1)\n", "p.py")],
                         env=clean_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"smprun: error: --config file '{missing}' does not exist (accepted: a JSON object "
        'like {"partitions": 2}, or the path of an existing JSON file)')


def test_cpp_init_under_torchrun_and_srun(tmp_path):
    """smp::init (C++) joins torchrun's agent store as a client too, and refuses a
    process srun started as one of several without RANK rather than train it alone."""
    example = os.path.join(BUILD, "bin", "cpp_ddp_example")
    if not os.path.exists(example):
        pytest.skip("examples not built")
    out = subprocess.run(
        [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--redirects", "1",
         "--tee", "1", "--monitor_interval", "0.5", "--log_dir", str(tmp_path / "logs"),
         "--master_port", str(free_port()), "--no_python", example, "--steps", "3"],
        env=clean_env(), cwd=str(tmp_path), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "done: 3 steps on 2 ranks" in out.stdout, out.stdout
    out = subprocess.run([example, "--steps", "1"], capture_output=True, text=True, timeout=60,
                         env=clean_env(SLURM_PROCID=1, SLURM_NTASKS=2, SLURM_LOCALID=1))
    assert out.returncode == 1
    assert out.stderr.strip() == (
        "cpp_ddp_example: smp: environment RANK is not set, but SLURM_PROCID=1 and "
        "SLURM_NTASKS=2 say this is one of several ranks; smp::init (C++) reads RANK, "
        "WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT: export them, "
        "or launch with smprun")
