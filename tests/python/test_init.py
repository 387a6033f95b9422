"""smp.init, topology, process groups and object collectives over real Gloo ranks."""
import json
import os
import subprocess
import time

import pytest

from conftest import PYTHON, rank_env, free_port

PREAMBLE = """
import json, os, sys
import torch, torch.distributed as dist
import smp
"""


def test_world_of_one_needs_no_env(tmp_path):
    env = {k: v for k, v in rank_env(0, 1, 0).items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}
    code = PREAMBLE + """
smp.init()
assert (smp.rank(), smp.size(), smp.pp_size(), smp.dp_size()) == (0, 1, 1, 1)
t = torch.ones(1); dist.all_reduce(t, group=smp.get_dp_process_group()); assert t.item() == 1
assert smp.allgather("x") == ["x"]
smp.send({"a": 1}, 0); assert smp.recv_from(0) == {"a": 1}
smp.barrier()
print("ok", smp.state.cfg.partitions)
"""
    out = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok 1"


def test_groups_match_topology(ranks):
    script = PREAMBLE + """
smp.init({"partitions": 2, "ddp": True})
r = smp.rank()
topo = {"pp": [[0, 1], [2, 3]], "dp": [[0, 2], [1, 3]]}
mine = lambda kind: next(g for g in topo[kind] if r in g)
assert smp.get_pp_group() == mine("pp") == smp.get_mp_group(), smp.get_pp_group()
assert smp.get_dp_group() == mine("dp") == smp.get_rdp_group()
assert smp.get_tp_group() == [r]
assert smp.pp_rank() == mine("pp").index(r) == smp.mp_rank()
assert smp.dp_rank() == mine("dp").index(r) == smp.rdp_rank()
assert (smp.pp_size(), smp.dp_size(), smp.tp_size(), smp.size()) == (2, 2, 1, 4)
# Each group really contains its ranks: allreduce the rank ids.
for kind, pg in (("pp", smp.get_pp_process_group()), ("dp", smp.get_dp_process_group()),
                 ("mp", smp.get_mp_process_group()), ("rdp", smp.get_rdp_process_group())):
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=pg)
    expect = sum(mine("dp" if kind in ("dp", "rdp") else "pp"))
    assert t.item() == expect, (kind, t.item(), expect)
t = torch.tensor([float(r)]); dist.all_reduce(t, group=smp.get_world_process_group())
assert t.item() == 6
assert dist.get_rank(smp.get_dp_process_group()) == smp.dp_rank()
assert dist.get_rank(smp.get_pp_process_group()) == smp.pp_rank()
assert smp.state.cfg.partitions == 2 and smp.state.cfg.ddp is True
print("ok")
"""
    for res in ranks(script, 4):
        assert res.stdout.strip() == "ok"


def test_spread_placement(ranks):
    script = PREAMBLE + """
smp.init({"partitions": 2, "placement_strategy": "spread"})
assert smp.get_dp_group() == ([0, 1] if smp.rank() < 2 else [2, 3]), smp.get_dp_group()
assert smp.get_pp_group() == [smp.rank() % 2, smp.rank() % 2 + 2]
"""
    ranks(script, 4)


def test_object_collectives(ranks):
    script = PREAMBLE + """
smp.init({"partitions": 2})
r = smp.rank()
assert smp.allgather({"r": r}) == [{"r": i} for i in range(4)]
assert smp.allgather(r, smp.DP_GROUP) == smp.get_dp_group()
assert smp.allgather(r, smp.CommGroup.PP_GROUP) == smp.get_pp_group()
assert smp.allgather(r, smp.TP_GROUP) == [r]
g = smp.gather(r * 10, smp.WORLD, rank=0)
assert g == ([0, 10, 20, 30] if r == 0 else None), g
# Buffered ring: everyone sends before anyone receives.
smp.send(("ring", r), (r + 1) % 4, smp.WORLD_RANK)
assert smp.recv_from((r + 3) % 4, smp.RankType.WORLD_RANK) == ("ring", (r + 3) % 4)
# Rank types address ranks inside the caller's own group.
other = 1 - smp.pp_rank()
smp.send(torch.arange(3) + r, other, smp.PP_RANK)
got = smp.recv_from(other, smp.MP_RANK)
assert torch.equal(got, torch.arange(3) + smp.get_pp_group()[other])
# broadcast is received with recv_from.
if smp.dp_rank() == 0:
    smp.broadcast({"from": r}, smp.DP_GROUP)
else:
    assert smp.recv_from(0, smp.DP_RANK) == {"from": smp.get_dp_group()[0]}
smp.barrier(); smp.pp_barrier(); smp.dp_barrier(); smp.mp_barrier(); smp.barrier(smp.TP_GROUP)
try:
    smp.send(1, 5, smp.PP_RANK)
    raise SystemExit("no error")
except ValueError as e:
    assert "PP_RANK 5 is outside its group of 2 ranks" in str(e), e
print("ok")
"""
    ranks(script, 4)


def test_config_sources(ranks, tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"microbatches": 3}))
    script = PREAMBLE + """
src = sys.argv[1]
if src == "path":
    smp.init(sys.argv[2])
else:
    smp.init()
print(smp.state.cfg.microbatches, smp.state.cfg.partitions, smp.num_microbatches())
"""
    res = ranks(script, 2, args=("path", str(path)))
    assert [r.stdout.split() for r in res] == [["3", "1", "3"]] * 2
    res = ranks(script, 2, env={"SMP_CONFIG": '{"microbatches": 5}'}, args=("env",))
    assert res[0].stdout.split() == ["5", "1", "5"]
    res = ranks(script, 2, env={"SM_HP_MP_PARAMETERS": '{"pipeline_parallel_degree": 2}'},
                args=("env",))
    assert res[1].stdout.split() == ["1", "2", "1"]
    # SMP_CONFIG wins over SageMaker's variable.
    res = ranks(script, 2, env={"SMP_CONFIG": '{"microbatches": 7}',
                                "SM_HP_MP_PARAMETERS": '{"microbatches": 2}'}, args=("env",))
    assert res[0].stdout.split() == ["7", "1", "7"]


def test_differing_config_fails_on_every_rank(ranks):
    script = PREAMBLE + """
mb = 4 if smp_rank == 3 else 2
try:
    smp.init({"partitions": 2, "microbatches": mb, "timeout_s": 30})
except smp.ConfigError as e:
    print("ConfigError:", e)
    sys.exit(3)
""".replace("smp_rank", "int(os.environ['RANK'])")
    start = time.monotonic()
    res = ranks(script, 4, check=False, timeout=60)
    assert time.monotonic() - start < 30
    for r in res:
        assert r.returncode == 3, r
        assert ("config 'microbatches' differs across ranks: 2 on ranks 0,1,2; 4 on rank 3"
                in r.stdout), r


def test_invalid_config_on_one_rank_fails_everywhere(ranks):
    script = PREAMBLE + """
cfg = {"pipeline": "gpipe"} if os.environ["RANK"] == "1" else {}
try:
    smp.init(cfg)
except ValueError as e:
    print(type(e).__name__, e)
    sys.exit(3)
"""
    for r in ranks(script, 2, check=False, timeout=60):
        assert r.returncode == 3, r
        assert ("ConfigError smp: invalid config on rank 1: smp: config 'pipeline'='gpipe' is not "
                "one of {interleaved, simple, 1f1b, zero_bubble}") in r.stdout, r


def test_world_not_divisible_by_partitions(ranks):
    script = PREAMBLE + """
try:
    smp.init({"partitions": 2})
except smp.ConfigError as e:
    print(e); sys.exit(3)
"""
    for r in ranks(script, 3, check=False, timeout=60):
        assert r.returncode == 3 and "does not divide the world size 3" in r.stdout, r


def test_missing_rank_times_out_naming_it(ranks):
    script = PREAMBLE + """
if os.environ["RANK"] == "2":
    sys.exit(0)  # never joins
try:
    smp.init({"timeout_s": 3})
except smp.SMPTimeoutError as e:
    print("timeout:", e); sys.exit(3)
"""
    start = time.monotonic()
    res = ranks(script, 3, check=False, timeout=60)
    assert time.monotonic() - start < 40
    for r in res[:2]:
        assert r.returncode == 3, r
        assert "waiting for the config of every rank (smp.init) from rank(s) 2" in r.stdout, r


def test_bad_config_messages_in_python():
    import smp
    with pytest.raises(ValueError, match=r"config key 'microbatch' is unknown \(did you mean "
                                         r"'microbatches'\?\)"):
        smp._C.parse_config('{"microbatch": 2}')
    with pytest.raises(smp.ConfigError, match="config of type int is not supported"):
        smp.init(3)
    with pytest.raises(smp.ConfigError, match="config file '/nonexistent.json' does not exist"):
        smp.init("/nonexistent.json")


def test_shim_is_the_same_module():
    import torch
    import smp
    import smdistributed.modelparallel.torch as smp2
    import smdistributed.modelparallel
    assert smp2 is smp
    # SMP's API level there, smp's own release here (tests/python/test_launchers.py).
    assert smdistributed.modelparallel.__version__ == smp.SMP_API_VERSION != smp.__version__
    for name in ("WORLD", "PP_GROUP", "DP_GROUP", "MP_GROUP", "TP_GROUP", "RDP_GROUP"):
        assert getattr(smp, name) is getattr(smp.CommGroup, name)
    # CPU: torch 2.x's CPU scaler (docs/mixed_precision.md); torch 1.13 has none.
    cpu_scaler = hasattr(torch, "amp") and hasattr(torch.amp, "GradScaler")
    assert smp.amp.GradScaler().is_enabled() is (cpu_scaler or torch.cuda.is_available())


def test_exit_shuts_down_a_script_that_did_not(ranks):
    # Note [Clean exit] (python/smp/runtime.py): after a clean end, smp's atexit handler
    # shuts smp down and destroys torch.distributed's groups (joining Gloo's workers)
    # before the interpreter finalizes. A handler registered before smp's runs after
    # it and sees what it left.
    script = """
import atexit
import torch, torch.distributed as dist
atexit.register(lambda: print("AT_EXIT", dist.is_initialized(), flush=True))
import smp
smp.init()
t = torch.ones(1)
dist.all_reduce(t)  # a script's last collective, then its end
print("SUM", t.item(), flush=True)
"""
    for r in ranks(script, 2):
        assert "SUM 2.0" in r.stdout and "AT_EXIT False" in r.stdout, r.stdout


MMAP = r"""
import os, sys
os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)  # (the job's own would win)
import torch
import smp
# Note [Fixed mmap threshold]: after a large block was freed, glibc's adaptive threshold
# serves smaller ones from its heap, where they stay resident once freed while anything
# allocated later sits above them. With the fixed threshold they are mapped and go.
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
try:
    smp.init({})
except smp.ConfigError as e:
    print("ERROR", e)
    sys.exit(0)
big = torch.ones(30 << 18)  # 30 MiB: raises the adaptive threshold once freed
del big
before = rss()
blocks = [torch.ones(6 << 18) for _ in range(16)]  # 96 MiB of 6 MiB blocks
pins = [torch.ones(16) for _ in range(64)]         # small, allocated above them
del blocks
grown = (rss() - before) / 2**20
print("KEPT", "%.0f" % grown, "MiB:", "freed" if grown < 32 else "resident")
smp.shutdown()
"""


@pytest.mark.parametrize("setting,freed", [(None, True), ("0", False), ("-5", None)])
def test_the_mmap_threshold_is_fixed_at_init(ranks, setting, freed):
    env = {"SMP_MMAP_THRESHOLD": setting} if setting is not None else {}
    (r,) = ranks(MMAP, 1, env=env)
    if setting == "-5":
        assert "ERROR smp: environment SMP_MMAP_THRESHOLD=-5 is not a number of bytes" in r.stdout
    elif freed:
        assert "freed" in r.stdout, r.stdout
    else:  # glibc's adaptive threshold: the 6 MiB blocks stay resident in its heap
        assert "resident" in r.stdout, r.stdout
