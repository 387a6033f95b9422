"""smp's logging (python/smp/log.py) on real 2-rank pp=2 jobs.

- By default rank 0 prints one summary line (no table) and no other rank prints one;
  its per-partition parameter counts equal what each rank really holds.
- SMP_LOG_LEVEL=debug (any case) adds the partition table; a bad value is a
  ConfigError naming the variable, the value and the allowed names, on every rank.
- An application's own logging configuration decides: its handler and format get
  smp's records and smp's stderr handler stands aside; its level is respected.
"""
import json
import re
import subprocess

from conftest import PYTHON, free_port, rank_env

SCRIPT = r"""
import json, logging, sys
import torch, torch.nn as nn
opts = json.loads(sys.argv[1])
if opts.get("basic_config"):
    logging.basicConfig(stream=sys.stdout, format="USER|%(name)s|%(message)s",
                        level=getattr(logging, opts["basic_config"]))
import smp
try:
    smp.init({"partitions": 2, "microbatches": 2, "timeout_s": 60})
except smp.ConfigError as e:
    print("CONFIG_ERROR", e, flush=True)
    sys.exit(3)
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                    nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 3))
model = smp.DistributedModel(net)

@smp.step
def step(x):
    out = model(x)
    model.backward(out.sum())
    return out

step(torch.randn(4, 8))
mine = sum(p.numel() for p in model.local_parameters())
counts = smp.allgather(mine, smp.PP_GROUP)
print("COUNTS", json.dumps({"counts": counts, "modules": len(list(net.named_modules()))}),
      flush=True)
"""


def _run(ranks, env=None, **opts):
    return ranks(SCRIPT, 2, args=(json.dumps(opts),), env=env or {}, timeout=120)


def _fmt(n):
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(n)


def _counts(result):
    line = next(x for x in result.stdout.splitlines() if x.startswith("COUNTS "))
    return json.loads(line[len("COUNTS "):])


def _smp_lines(text):
    return [x for x in text.splitlines() if x.startswith("smp")]


def test_default_prints_one_summary_line_on_rank_0(ranks):
    res = _run(ranks)
    got = _counts(res[0])
    want = (f"smp: partitioned {got['modules']} modules into 2 partitions: "
            f"{'/'.join(_fmt(c) for c in got['counts'])} params (rank 0; "
            "SMP_LOG_LEVEL=DEBUG for the table)")
    assert res[0].stderr.strip().splitlines() == [want], res[0]
    assert res[1].stderr.strip() == "", res[1]


def test_debug_level_adds_the_table(ranks):
    # (With a job secret, as smprun gives: no DEBUG line about its absence.)
    res = _run(ranks, env={"SMP_LOG_LEVEL": "debug", "SMP_JOB_SECRET": "ab" * 32})
    lines = _smp_lines(res[0].stderr)
    assert lines[0].startswith("smp: partitioned "), res[0]
    assert lines[1] == "smp: partition plan", res[0]
    table = res[0].stderr.split("smp: partition plan\n", 1)[1]
    assert re.search(r"^module\s+kind\s+partition\s+params\s+cost", table, re.M), table
    assert re.search(r"^\s+partition\s+modules\s+units\s+params\s+cost", table, re.M), table
    assert "partition" not in res[1].stderr, res[1]


def test_bad_level_is_a_clear_error_on_every_rank(ranks):
    res = ranks(SCRIPT, 2, args=(json.dumps({}),), env={"SMP_LOG_LEVEL": "loud"}, timeout=60,
                check=False)
    for r in res:
        assert r.returncode == 3, r
        assert ("CONFIG_ERROR smp: environment SMP_LOG_LEVEL='loud' is not one of "
                "{CRITICAL, ERROR, WARNING, INFO, DEBUG} (case-insensitive)") in r.stdout, r


def test_application_logging_config_is_respected(ranks):
    # The application's handler (stdout, its format) gets the summary; stderr stays quiet.
    res = _run(ranks, basic_config="INFO")
    lines = [x for x in res[0].stdout.splitlines() if x.startswith("USER|")]
    n = _counts(res[0])["modules"]
    assert len(lines) == 1 and lines[0].startswith(f"USER|smp.partition|smp: partitioned {n} "
                                                   "modules into 2 partitions"), res[0]
    assert _smp_lines(res[0].stderr) == [], res[0]
    assert not [x for x in res[1].stdout.splitlines() if x.startswith("USER|")], res[1]
    # Its level too: WARNING hides smp's INFO summary (SMP_LOG_LEVEL unset).
    res = _run(ranks, basic_config="WARNING")
    for r in res:
        assert "partitioned" not in r.stdout + r.stderr, r


HANDLER = r"""
import io, logging, sys
import smp
from smp import log
if sys.argv[1] == "own-level":
    logging.getLogger("smp").setLevel(logging.ERROR)   # set by the application
log.configure()
log.configure()                                       # idempotent: one handler
assert len(logging.getLogger("smp").handlers) == 1
logging.getLogger("smp.x").info("smp: info line")
logging.getLogger("smp.x").error("smp: error line")
if sys.argv[1] == "late-config":
    # Configured after smp.init: smp's handler stands aside from then on (no duplicates).
    logging.basicConfig(stream=sys.stdout, format="USER %(message)s")
    logging.getLogger("smp.x").error("smp: after config")
"""


def _handler_cases(tmp_path, cases):
    """Runs HANDLER once per (case, env), all at once (each pays torch's import)."""
    script = tmp_path / "handler.py"
    script.write_text(HANDLER)
    procs = [subprocess.Popen([PYTHON, str(script), case], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=rank_env(0, 1, free_port(), env))
             for case, env in cases]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return outs


def test_default_handler_levels_and_standing_aside(tmp_path):
    plain, warning, own, late = _handler_cases(
        tmp_path, [("plain", None), ("plain", {"SMP_LOG_LEVEL": "Warning"}),
                   ("own-level", None), ("late-config", None)])
    assert plain.stderr.splitlines() == ["smp: info line", "smp: error line"], plain.stderr
    assert warning.stderr.splitlines() == ["smp: error line"], warning.stderr
    # The application's level on `smp` is kept.
    assert own.stderr.splitlines() == ["smp: error line"], own.stderr
    assert late.stderr.splitlines() == ["smp: info line", "smp: error line"], late.stderr
    assert late.stdout.splitlines() == ["USER smp: after config"], late.stdout
