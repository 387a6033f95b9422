"""Jobs across hosts: network namespaces joined by a bridge (tests/hosts/netns.py), one
smprun per host, each with its own host name (resolving to nothing) and address.

- 2 hosts x 2 ranks, pp=2 x dp=2, with each replica's stages inside a host
  ("cluster": the dp groups span the hosts) and across them ("spread"): every rank's
  weights equal the same model trained in one process;
- a host killed, and a host's link cut, during training: every launcher exits, naming
  the lost node's host and ranks (detection times printed, not asserted).

Skipped, with the reason, where namespaces cannot be made (not root).
"""
import json
import os
import secrets
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
import netns  # noqa: E402  (beside this file)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.abspath(os.environ.get("SMP_BUILD_DIR", os.path.join(REPO, "build")))

ok, why = netns.available()
pytestmark = pytest.mark.skipif(not ok, reason=why or "namespaces unavailable")

TRAIN = r"""
import copy, json, socket, sys
import torch, torch.nn as nn
import smp
opts = json.loads(sys.argv[1])
smp.init({"partitions": 2, "microbatches": 2, "ddp": True,
          "placement_strategy": opts["placement"], "timeout_s": 60})
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))
ref = copy.deepcopy(net)
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

@smp.step
def train_step(x, y):
    loss = nn.functional.mse_loss(model(x), y)
    model.backward(loss)
    return loss

for i in range(4):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8 * smp.dp_size(), 8, generator=g), torch.randn(8 * smp.dp_size(), 3, generator=g)
    mine = slice(8 * smp.dp_rank(), 8 * (smp.dp_rank() + 1))
    opt.zero_grad()
    train_step(x[mine], y[mine])
    opt.step()
    ref_opt.zero_grad()
    for d in range(smp.dp_size()):        # one process: every replica's microbatches
        for m in range(2):
            s = slice(8 * d + 4 * m, 8 * d + 4 * (m + 1))
            (nn.functional.mse_loss(ref(x[s]), y[s]) / (2 * smp.dp_size())).backward()
    ref_opt.step()
full = model.state_dict()
for k, v in ref.state_dict().items():
    torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
print("EQUAL", json.dumps({"rank": smp.rank(), "host": socket.gethostname(),
                           "pp": smp.pp_rank(), "dp": smp.dp_rank()}), flush=True)
"""


def _start(hosts, tmp_path, script, args=(), nproc=2, ifname="eth0", extra_path=None,
           launcher_args=()):
    """One smprun per host running `script`, sharing a secret; returns the processes
    (stdout and stderr together, text)."""
    path = tmp_path / "job.py"
    path.write_text(script)
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                   [os.path.join(BUILD, "python")] + ([extra_path] if extra_path else [])),
               OMP_NUM_THREADS="1", SMP_PYTHON=sys.executable)
    env.pop("GLOO_SOCKET_IFNAME", None)
    env.pop("NCCL_SOCKET_IFNAME", None)
    if ifname:
        env["GLOO_SOCKET_IFNAME"] = ifname
    return [hosts.popen(i, [os.path.join(BUILD, "bin", "smprun"), "--nnodes", hosts.n,
                            "--node_rank", i, "--nproc_per_node", nproc,
                            "--master_addr", hosts.addr(0), "--master_port", 29500,
                            "--secret_file", secret, *launcher_args, path, *args],
                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(hosts.n)]


def _job(tmp_path, script, opts, nodes=2, nproc=2, timeout=120, ifname="eth0"):
    with netns.Hosts(nodes) as hosts:
        procs = _start(hosts, tmp_path, script, (json.dumps(opts),), nproc, ifname)
        outs = []
        for p in procs:
            try:
                outs.append((p.wait(timeout=timeout), p.stdout.read()))
            except subprocess.TimeoutExpired:
                hosts.kill()
                outs.append((None, p.stdout.read() + "\n[killed at timeout]"))
    return outs


# "cluster" with the user's GLOO_SOCKET_IFNAME; "spread" without it: the host names
# resolve to nothing, so Gloo alone would bind loopback and fail to connect (torch's
# own init does), and smp picks the interface that routes to the master
# (Note [Gloo's interface]), once a host.
@pytest.mark.parametrize("placement,pp_inside_host,ifname", [("cluster", True, "eth0"),
                                                             ("spread", False, None)])
def test_pp2_dp2_over_two_hosts_equals_one_process(tmp_path, placement, pp_inside_host, ifname):
    outs = _job(tmp_path, TRAIN, {"placement": placement}, ifname=ifname)
    assert all(rc == 0 for rc, _ in outs), "\n".join(out for _, out in outs)
    seen = [json.loads(line.split("EQUAL ", 1)[1]) for _, out in outs
            for line in out.splitlines() if "EQUAL " in line]
    assert sorted(s["rank"] for s in seen) == [0, 1, 2, 3], seen
    hosts = {s["rank"]: s["host"] for s in seen}
    assert hosts == {0: "host0", 1: "host0", 2: "host1", 3: "host1"}, hosts
    stage_hosts = {}
    for s in seen:
        stage_hosts.setdefault(s["dp"], set()).add(s["host"])
    # A replica's two stages: on one host ("cluster"), or on both ("spread").
    assert all(len(h) == (1 if pp_inside_host else 2) for h in stage_hosts.values()), seen
    for i, (_, out) in enumerate(outs):
        said = [ln for ln in out.splitlines() if "smp: Gloo binds" in ln]
        if ifname:
            assert not said, said  # the user's setting wins, silently
        else:
            assert len(said) == 1 and "Gloo binds eth0" in said[0] and \
                "routes to the master 10.77.0.1" in said[0], out


# Note [Hierarchical reduction]: dp=4 over 2 hosts x 2 ranks sums in shared memory
# within each host and over Gloo (eth0) between them; the same job on one machine with
# SMP_FAKE_HOSTS=2 (4 ranks counted as 2 hosts) does the same arithmetic over loopback,
# so with PowerSGD (run on the hosts' first ranks over the hosts group) the two must be
# bitwise equal. The script (tests/python/test_hierarchy.py) also checks
# itself against one process (default reduction) and that replicas are equal. The
# PowerSGD job runs without GLOO_SOCKET_IFNAME: the links between hosts, made in C++
# after init, pick the interface toward the master as torch's groups did.
@pytest.mark.parametrize("hook,ifname", [(None, "eth0"), ("powersgd", None)])
def test_dp4_over_two_hosts_reduces_hierarchically(tmp_path, hook, ifname):
    import torch
    sys.path.insert(0, os.path.join(REPO, "tests", "python"))
    from test_hierarchy import TRAIN as HIER  # noqa: E402
    nets = os.path.join(REPO, "tests", "python")
    opts = {"hook": hook, "out": str(tmp_path / "hosts.pt")}
    with netns.Hosts(2) as hosts:
        procs = _start(hosts, tmp_path, HIER, (json.dumps(opts),), ifname=ifname,
                       extra_path=nets)
        outs = [(p.wait(timeout=120), p.stdout.read()) for p in procs]
    assert all(rc == 0 for rc, _ in outs), "\n".join(out for _, out in outs)
    assert "spans 2 hosts x 2 ranks" in outs[0][1], outs[0][1]
    if hook is None:
        # The job checked itself against one process (1e-5) and its replicas against each
        # other; the default path's hierarchical-against-flat arithmetic is
        # tests/python/test_hierarchy.py's. The bitwise comparison with one machine is
        # PowerSGD's below (the "bit-identical to its single-host run").
        return
    one = dict(opts, out=str(tmp_path / "one.pt"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(BUILD, "python"), nets]),
               OMP_NUM_THREADS="1", SMP_FAKE_HOSTS="2", SMP_PYTHON=sys.executable)
    run = subprocess.run([os.path.join(BUILD, "bin", "smprun"), "--nproc_per_node", "4",
                          tmp_path / "job.py", json.dumps(one)], env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert run.returncode == 0, run.stdout
    a, b = torch.load(opts["out"]), torch.load(one["out"])
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max())


LOOP = r"""
import time, torch, smp
smp.init({"partitions": 2, "microbatches": 2, "ddp": True})
model = smp.DistributedModel(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)))

@smp.step
def step(x):
    loss = model(x).sum()
    model.backward(loss)
    return loss

for i in range(100000):
    step(torch.randn(4, 8))
    if i == 3:
        print("TRAINING", flush=True)
    time.sleep(0.01)
"""


# "slow_lossy_cut": host 1's link holds every frame 20 ms each way (a 40 ms round
# trip) and drops 2% of them from the start (the rendezvous and the training go
# through it), then is cut during the training's collectives (a cut of a clean link
# behaves the same: 5.1 s on both sides, docs/hosts.md).
@pytest.mark.parametrize("fault", ["killed", "slow_lossy_cut"])
def test_lost_host_is_named_by_every_launcher(tmp_path, fault):
    with netns.Hosts(2) as hosts:
        if fault == "slow_lossy_cut":
            hosts.shape(1, delay_ms=20, loss_pct=2)
        procs = _start(hosts, tmp_path, LOOP)
        # Both hosts train before the fault.
        deadline = time.monotonic() + 60
        seen = ""
        while "TRAINING" not in seen and time.monotonic() < deadline:
            line = procs[0].stdout.readline()
            if not line:
                break
            seen += line
        assert "TRAINING" in seen, seen
        t0 = time.monotonic()
        if fault == "killed":
            hosts.kill(1)
        else:
            hosts.cut(1)
        watch = [0] if fault == "killed" else [0, 1]  # a killed host says nothing
        for i in watch:
            rc = procs[i].wait(timeout=60)
            out = procs[i].stdout.read()
            took = time.monotonic() - t0
            print(f"{fault}: host{i}'s launcher exited {rc} after {took:.1f} s")
            assert rc == 1, out
            lost = "host 'host1', ranks 2-3" if i == 0 else "host 'host0', ranks 0-1"
            assert lost in out, out


RESUME = r"""
import json, os, socket, sys, time
import torch, torch.nn as nn
import smp
out, plan = sys.argv[1], json.loads(sys.argv[2])
attempt = int(os.environ["SMP_RESTART_COUNT"])
smp.init({"partitions": 2, "microbatches": 2, "ddp": True, "placement_strategy": "cluster",
          "timeout_s": 60})
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.GELU(), nn.Linear(32, 4))
model = smp.DistributedModel(net)
opt = smp.DistributedOptimizer(torch.optim.AdamW(net.parameters(), lr=1e-2))

@smp.step
def train(x, y):
    loss = nn.functional.cross_entropy(model(x), y)
    model.backward(loss)
    return loss

first_real = None
for step in range(10):
    if attempt == 0 and step == plan.get("cut_at"):
        # Host 1's ranks stop here; host 0's go on into the step and wait in a collective
        # for them, so the cut finds them inside Gloo.
        if socket.gethostname() == "host1":
            open(plan["paused"], "w").close()
            time.sleep(3600)
    g = torch.Generator().manual_seed(1000 * step + smp.dp_rank())
    loss = train(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
    opt.step()
    opt.zero_grad()
    if first_real is None and loss.reduce_mean().item() == loss.reduce_mean().item():
        first_real = step  # not NaN: computed, not fast-forwarded
    if step % 3 == 2:
        smp.save_checkpoint(os.environ["SMP_CHECKPOINT_DIR"], tag=f"step{step + 1}")
final = model.state_dict()
if smp.rank() == 0:
    torch.save(final, out)
    print("RESUMED", json.dumps({"attempt": attempt, "first_real_step": first_real}), flush=True)
"""


def _resume_job(tmp_path, plan, during=None):
    """RESUME on 2 hosts x 2 ranks under --max_restarts 1; `during(hosts, procs, lines)`
    runs while it does. Returns (final weights, RESUMED info, each launcher's lines)."""
    import threading
    import torch
    tmp_path.mkdir(exist_ok=True)
    out = tmp_path / "final.pt"
    with netns.Hosts(2) as hosts:
        procs = _start(hosts, tmp_path, RESUME, (out, json.dumps(plan)),
                       launcher_args=("--max_restarts", 1, "--checkpoint_dir",
                                      tmp_path / "ckpt"))
        lines = [[], []]  # (monotonic time, line) as they come

        def read(i):
            for line in procs[i].stdout:
                lines[i].append((time.monotonic(), line.rstrip()))
        readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
        for r in readers:
            r.start()
        if during:
            during(hosts, procs, lines)
        for i, p in enumerate(procs):
            rc = p.wait(timeout=120)
            readers[i].join(timeout=10)
            assert rc == 0, "\n".join(ln for _, ln in lines[i])
    said = [ln.split("RESUMED ", 1)[1] for _, ln in lines[0] if "RESUMED " in ln]
    assert said, "\n".join(ln for _, ln in lines[0])
    return torch.load(out), json.loads(said[0]), lines


def _wait_for(lines, text, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        hit = [t for t, ln in list(lines) if text in ln]
        if hit:
            return hit[0]
        time.sleep(0.1)
    raise AssertionError(f"not said within {timeout} s: {text}\n" +
                         "\n".join(ln for _, ln in lines))


# Note [Rejoining after a lost node] (launcher/coordinator.cpp): host 1's link is cut
# while host 0's ranks wait for it inside a collective; both launchers stop their ranks,
# node 1's keeps trying to reach node 0, which listens again; the link comes back, and
# the job restarts from the newest checkpoint (step 6) and ends bitwise equal to the run
# that was never cut. Times printed, not asserted.
def test_restart_after_a_restored_cut_resumes_bitwise(tmp_path):
    paused = tmp_path / "cut" / "paused"

    def cut_then_restore(hosts, procs, lines):
        deadline = time.monotonic() + 90
        while not paused.exists():
            assert time.monotonic() < deadline and procs[0].poll() is None, \
                "\n".join(ln for _, ln in lines[0] + lines[1])
            time.sleep(0.1)
        time.sleep(0.5)  # host 0's ranks are inside the step's collectives by now
        t0 = time.monotonic()
        hosts.cut(1)
        t_coord = _wait_for(lines[0], "waiting for node ranks 1 to join again", 30)
        t_worker = _wait_for(lines[1], "joining node 0 at 10.77.0.1:29501 again", 30)
        time.sleep(2)  # node 1's launcher tries, and fails, while the link is down
        hosts.restore(1)
        t_back = time.monotonic()
        t_restart = _wait_for(lines[0], "restarting the job (restart 1 of 1)", 60)
        print(f"restored cut: node 0 noticed after {t_coord - t0:.1f} s, node 1 after "
              f"{t_worker - t0:.1f} s; restarted {t_restart - t_back:.1f} s after the link "
              f"came back")

    final, info, lines = _resume_job(tmp_path / "cut", {"cut_at": 7, "paused": str(paused)},
                                     cut_then_restore)
    assert info == {"attempt": 1, "first_real_step": 6}, info
    out0 = "\n".join(ln for _, ln in lines[0])
    assert "host 'host1', ranks 2-3" in out0, out0
    assert "restarts used: 1 of 1" in out0, out0
    ref, ref_info, _ = _resume_job(tmp_path / "ref", {})
    assert ref_info == {"attempt": 0, "first_real_step": 0}, ref_info
    import torch
    assert final.keys() == ref.keys()
    for k in final:
        assert torch.equal(final[k], ref[k]), k


# A host that cannot reach the master at start: each launcher names the other side
# within kRendezvousNoticeS (10 s) and keeps trying (nodes may start minutes apart)
# until --rdzv_timeout, then exits naming it. Times printed, not asserted.
def test_unreachable_master_is_named_by_both_launchers(tmp_path):
    import threading
    with netns.Hosts(2) as hosts:
        hosts.cut(1)
        t0 = time.monotonic()
        procs = _start(hosts, tmp_path, LOOP, launcher_args=("--rdzv_timeout", 12))
        lines = [[], []]  # (seconds since start, line) per launcher, read as they come

        def read(i):
            for line in procs[i].stdout:
                lines[i].append((time.monotonic() - t0, line.strip()))
        readers = [threading.Thread(target=read, args=(i,)) for i in range(2)]
        for r in readers:
            r.start()
        for i, p in enumerate(procs):
            rc = p.wait(timeout=60)
            readers[i].join(timeout=10)
            out = "\n".join(ln for _, ln in lines[i])
            assert rc == 1, out
            took, notice = [(t, ln) for t, ln in lines[i]
                            if "cannot reach" in ln or "waiting for" in ln][0]
            print(f"unreachable master: host{i}'s launcher said after {took:.1f} s: {notice}; "
                  f"exited after {lines[i][-1][0]:.1f} s")
            assert took < 15, out
            if i == 0:
                assert "waiting for node ranks 1 to join on 10.77.0.1:29501" in notice, out
                assert "only 1 of 2 nodes joined within 12 s (missing node ranks: 1)" in out, out
            else:
                assert "node 1 (host 'host1') cannot reach the coordinator (node 0) at " \
                    "10.77.0.1:29501" in notice, out
                assert "cannot reach the coordinator (node 0) at 10.77.0.1:29501 within 12 s" \
                    in out, out


# Under torchrun there is no smprun heartbeat between hosts. A cut: Note [Rank
# heartbeat] (smp_core/liveness.cpp) stops every rank within SMP_RANK_HEARTBEAT_S (10 s),
# each naming the other side's host and ranks. A killed host: Gloo fails at once with
# the peer's address, which smp names (Note [Peers by address], comm.cpp). The
# torchruns then exit non-zero. Times printed, not asserted.
@pytest.mark.parametrize("fault", ["cut", "killed"])
def test_fault_under_torchrun_is_named_by_every_rank(tmp_path, fault):
    import threading
    path = tmp_path / "job.py"
    path.write_text(LOOP)
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"), OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="eth0", SMP_JOB_SECRET=secrets.token_hex(32))
    with netns.Hosts(2) as hosts:
        if fault == "cut":
            hosts.shape(1, delay_ms=20)  # a 40 ms round trip; the cut comes mid-collective
        procs = [hosts.popen(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes", 2,
                                 "--node_rank", i, "--nproc_per_node", 2, "--master_addr",
                                 hosts.addr(0), "--master_port", 29500, path],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
        lines = [[], []]
        training = threading.Event()

        def read(i):
            for line in procs[i].stdout:
                if "TRAINING" in line:
                    training.set()
                lines[i].append((time.monotonic(), line.rstrip()))
        readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
        for r in readers:
            r.start()
        assert training.wait(90), "\n".join(ln for _, ln in lines[0] + lines[1])
        t0 = time.monotonic()
        if fault == "cut":
            hosts.cut(1)
        else:
            hosts.kill(1)  # every process of host 1, torchrun's ranks included
        for i in [0, 1] if fault == "cut" else [0]:
            rc = procs[i].wait(timeout=40)
            readers[i].join(timeout=10)
            out = "\n".join(ln for _, ln in lines[i])
            assert rc != 0, out
            other = "ranks 2-3 on host 'host1'" if i == 0 else "ranks 0-1 on host 'host0'"
            named = [(t - t0, ln) for t, ln in lines[i] if other in ln and "smp" in ln]
            assert named, out
            if fault == "cut":  # each rank says it (torchrun may stop the second first)
                assert "stopping this rank" in named[0][1], out
            print(f"torchrun {fault}: host{i}: first said after {named[0][0]:.1f} s: "
                  f"{named[0][1][:300]}; torchrun exited {rc} after "
                  f"{time.monotonic() - t0:.1f} s")


# The harness itself: a delay (no netem in this kernel: tests/hosts/linkdelay.cpp
# forwards host 1's link). D each way, so a TCP round trip between the hosts takes at
# least 2 D; bytes cross and come back intact; delay 0 puts the link back on the bridge.
ECHO = r"""
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(4)
while True:
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (b := c.recv(1 << 16)):
        c.sendall(b)
    c.close()
"""
ECHO_CLIENT = r"""
import json, os, socket, sys, threading, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], 5001)); break
    except OSError: time.sleep(0.05)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(5):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
data = os.urandom(4 << 20)
threading.Thread(target=c.sendall, args=(data,), daemon=True).start()
back = bytearray()
while len(back) < len(data) and (b := c.recv(1 << 20)):
    back += b
print(json.dumps({"rtts": rtts, "intact": bytes(back) == data}))
"""


def test_delayed_link():
    delay = 0.020
    with netns.Hosts(2) as hosts:
        hosts.popen(1, [sys.executable, "-c", ECHO])

        def round_trips():
            out = subprocess.run(hosts.command(0, [sys.executable, "-c", ECHO_CLIENT,
                                                   hosts.addr(1)]),
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            got = json.loads(out.stdout)
            assert got["intact"]
            return min(got["rtts"])

        hosts.shape(1, delay_ms=delay * 1000)
        delayed = round_trips()
        hosts.shape(1, delay_ms=0)
        plain = round_trips()
        print(f"TCP round trip: {delayed * 1e3:.2f} ms with {delay * 1e3:.0f} ms each way, "
              f"{plain * 1e3:.2f} ms without")
        assert 2 * delay <= delayed < 4 * delay
        assert plain < delay
