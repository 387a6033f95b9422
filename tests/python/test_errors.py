"""Errors that name the call: an smp collective that only some ranks of a group make.

Each script runs on real ranks over Gloo with timeout_s=120: every rank must raise the
named error long before that (the rank that went elsewhere too), with the same text on
every rank that raises (Note [Call agreement] in smp_core/call_agreement.h).
"""
import json
import re

SCRIPT = r"""
import json, sys, time
import torch, torch.nn as nn
import smp

opts = json.loads(sys.argv[1])
smp.init(dict({"timeout_s": 120}, **opts.get("cfg", {})))
if opts.get("model"):
    model = smp.DistributedModel(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    @smp.step
    def step(x):
        out = model(x)
        model.backward(out.sum())
        return out
    step(torch.randn(2, 4))

def call(what):
    if what == "state_dict":
        return model.state_dict()
    if what == "barrier":
        return smp.barrier()
    if what == "allgather":
        return smp.allgather(smp.rank())
    if what == "save":
        return smp.save(model.local_state_dict(), opts["path"], partial=True)
    if what == "exit":
        sys.exit(0)
    if what == "fail":
        raise RuntimeError(f"boom on rank {smp.rank()}")
    if what == "kill":
        import os, signal
        os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs
    if what == "sleep_then_state_dict":
        time.sleep(1.5)  # merely slow: not an error
        return model.state_dict()
    if what == "wait_for_file":  # busy elsewhere until rank 0 is done
        import os
        while not os.path.exists(opts["path"]):
            time.sleep(0.05)
        return None
    raise ValueError(what)

t0 = time.monotonic()
what = opts["calls"][smp.rank()]
if what == "fail":
    call(what)  # uncaught: this rank's exit reports it
try:
    out = call(what)
    print("RESULT", type(out).__name__, flush=True)
except Exception as e:
    print(f"RAISED {type(e).__name__} {time.monotonic() - t0:.1f}", flush=True)
    print("TEXT", e, flush=True)
    if opts.get("signal_path"):
        open(opts["signal_path"], "w").close()
"""

_RULE = "; every rank of a group must make the same smp calls in the same order"


def _run(ranks, calls, tmp_path, **opts):
    opts = dict(opts, calls=calls)
    return ranks(SCRIPT, len(calls), check=False, args=(json.dumps(opts),), timeout=90)


def _raised(r):
    """(exception type, seconds, text) printed by a rank."""
    m = re.search(r"^RAISED (\w+) ([\d.]+)$", r.stdout, re.M)
    assert m, r
    return m.group(1), float(m.group(2)), r.stdout.split("TEXT ", 1)[1].strip()


def _assert_named(res, raising, pattern):
    """Every rank in `raising` raised CommError with one text matching `pattern` (a
    regex of the whole message) long before timeout_s=120."""
    texts = []
    for rank in raising:
        kind, seconds, text = _raised(res[rank])
        assert kind == "CommError", res[rank]
        assert seconds < 60, (rank, seconds)  # named, not the 120 s timeout
        assert re.fullmatch(pattern, text), (rank, text)
        texts.append(text)
    assert len(set(texts)) == 1, texts


PP2 = {"cfg": {"partitions": 2}, "model": True}


def test_state_dict_on_one_rank_while_the_other_enters_a_barrier(ranks, tmp_path):
    res = _run(ranks, ["state_dict", "barrier"], tmp_path, **PP2)
    _assert_named(res, [0, 1], re.escape(
        "smp: ranks [0] of the pp group [0, 1] called model.state_dict() (call #") +
        r"\d+" + re.escape(" on that group), but rank 1 called smp.barrier(WORLD) (its call #") +
        r"\d+" + re.escape(" on the world group [0, 1])" + _RULE))


def test_state_dict_on_one_rank_while_the_other_exits(ranks, tmp_path):
    res = _run(ranks, ["state_dict", "exit"], tmp_path, **PP2)
    assert res[1].returncode == 0, res[1]
    _assert_named(res, [0], re.escape(
        "smp: ranks [0] of the pp group [0, 1] called model.state_dict() (call #") +
        r"\d+" + re.escape(" on that group), but rank 1 exited without making that call" +
        _RULE))


def test_the_store_host_exits_while_the_other_rank_waits(ranks, tmp_path):
    # Rank 0 hosts the job's store: it lingers at exit until rank 1 has read its mark.
    res = _run(ranks, ["exit", "state_dict"], tmp_path, **PP2)
    assert res[0].returncode == 0, res[0]
    _assert_named(res, [1], re.escape(
        "smp: ranks [1] of the pp group [0, 1] called model.state_dict() (call #") +
        r"\d+" + re.escape(" on that group), but rank 0 exited without making that call" +
        _RULE))


def test_state_dict_on_one_rank_while_the_other_fails(ranks, tmp_path):
    res = _run(ranks, ["state_dict", "fail"], tmp_path, **PP2)
    assert res[1].returncode == 1 and "RuntimeError: boom on rank 1" in res[1].stderr, res[1]
    _assert_named(res, [0], re.escape(
        "smp: ranks [0] of the pp group [0, 1] called model.state_dict() (call #") +
        r"\d+" + re.escape(" on that group), but rank 1 failed (RuntimeError: boom on rank 1) "
                           "without making that call" + _RULE))


def test_state_dict_on_one_rank_while_the_other_is_killed(ranks, tmp_path):
    res = _run(ranks, ["state_dict", "kill"], tmp_path, **PP2)
    assert res[1].returncode == -9, res[1]
    _assert_named(res, [0], re.escape(
        "smp: ranks [0] of the pp group [0, 1] called model.state_dict() (call #") +
        r"\d+" + re.escape(" on that group), but rank 1 died (pid ") + r"\d+" +
        re.escape(" is gone) without making that call" + _RULE))


def test_save_on_one_rank_while_the_other_enters_a_barrier(ranks, tmp_path):
    res = _run(ranks, ["save", "barrier"], tmp_path, path=str(tmp_path / "ckpt"), **PP2)
    _assert_named(res, [0, 1], re.escape(
        "smp: ranks [0] of the pp group [0, 1] called smp.save() (call #") +
        r"\d+" + re.escape(" on that group), but rank 1 called smp.barrier(WORLD) (its call #") +
        r"\d+" + re.escape(" on the world group [0, 1])" + _RULE))


def test_barrier_against_allgather_on_one_group(ranks, tmp_path):
    # No model: these are the first calls on the world group, so the numbers are known.
    res = _run(ranks, ["barrier", "allgather"], tmp_path)
    _assert_named(res, [0, 1], re.escape(
        "smp: ranks [0] of the world group [0, 1] called smp.barrier(WORLD) (call #1 on that "
        "group), but rank 1 called smp.allgather(WORLD) (its call #1 on the world group "
        "[0, 1])" + _RULE))


def test_a_slow_rank_is_no_error(ranks, tmp_path):
    res = _run(ranks, ["state_dict", "sleep_then_state_dict"], tmp_path, **PP2)
    for r in res:
        assert r.returncode == 0 and "RESULT OrderedDict" in r.stdout, r


def test_timeout_names_the_call_and_the_missing_rank(ranks, tmp_path):
    # Rank 1 is busy elsewhere (no smp call) until rank 0 has timed out.
    signal = str(tmp_path / "done")
    res = _run(ranks, ["barrier", "wait_for_file"], tmp_path, cfg={"timeout_s": 3},
               path=signal, signal_path=signal)
    kind, _, text = _raised(res[0])
    assert kind == "SMPTimeoutError", res[0]
    assert text == ("smp: timed out after 3 s waiting for ranks [1] of the world group [0, 1] "
                    "to call smp.barrier(WORLD) (call #1 on that group; ranks [0] called it); "
                    "rank 1 has made no smp collective call"), text
    assert res[1].returncode == 0 and "RESULT NoneType" in res[1].stdout, res[1]
