"""`pip install .` and `pip wheel .` (pyproject.toml, docs/install.md) into a fresh virtual
environment that holds only torch: the wheel's contents, `import smp` and
`smdistributed.modelparallel.torch` with no PYTHONPATH, a 2-rank pipeline job started by
the installed `smprun` compared with the same model trained in one process, and the
failure in an environment without torch.

Slow and needs pip's index (the build backend, numpy): runs only with
SMP_TEST_PIP_INSTALL=1. About 10.5 minutes on 2 cores: the cold build of `pip install`
(~6 min), then `pip wheel` on the same build directory (~3.5 min: scikit-build-core
configures afresh in each isolated build environment, which rebuilds the shared
precompiled header and the libraries using it; the launcher and bindings are reused). The environment is the test
interpreter's (.venv) site-packages hard-linked into a new venv, minus everything but
torch and pip, so no torch is downloaded; the source is a copy of the working tree's
files (tracked and untracked, not ignored), so uncommitted edits are what is tested.
"""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import PYTHON, REPO

pytestmark = pytest.mark.skipif(
    os.environ.get("SMP_TEST_PIP_INSTALL") != "1",
    reason="slow (a full build): set SMP_TEST_PIP_INSTALL=1 to test `pip install .`")

# What the test interpreter's environment holds besides torch and pip (.venv: pytest and
# numpy with their dependencies, requirements.txt).
NOT_TORCH = ("numpy", "pytest", "iniconfig", "pluggy", "pygments", "packaging")
# Variables that would make a child see something else than the fresh environment.
FOREIGN_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "VIRTUAL_ENV", "SMP_PYTHON",
                "SMP_CONFIG", "SM_HP_MP_PARAMETERS", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")

JOB = r'''
"""Three SGD steps of a small MLP: `ref` in one plain process, `smp` as a pipeline job."""
import json, sys
import torch, torch.nn as nn


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batches():
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 8, generator=gen), torch.randn(8, 3, generator=gen))
            for _ in range(3)]


def result(losses, state, **extra):
    return dict(losses=losses, state={k: v.tolist() for k, v in state.items()}, **extra)


if sys.argv[1] == "ref":
    net = build()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    losses = []
    for x, y in batches():
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step(); opt.zero_grad()
        losses.append(loss.item())
    print("RESULT " + json.dumps(result(losses, net.state_dict())))
else:
    import smp
    import smdistributed.modelparallel.torch as smp_api
    assert smp_api is smp
    smp.init()  # partitions and microbatches from smprun --config
    net = build()
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    model = smp.DistributedModel(net)
    opt = smp.DistributedOptimizer(opt)

    @smp.step
    def train_step(x, y):
        loss = nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        return loss

    losses = []
    for x, y in batches():
        loss = train_step(x, y)
        opt.step(); opt.zero_grad()
        losses.append(loss.reduce_mean().item())
    state = model.state_dict()  # gathered over the pipeline, the plain module's keys
    owned = smp.allgather([n for n, _ in model.local_named_parameters()], smp.MP_GROUP)
    where = smp.allgather([sys.executable, smp.__file__], smp.MP_GROUP)
    if smp.rank() == 0:
        print("RESULT " + json.dumps(result(losses, state, owned=owned, where=where,
                                            size=smp.size(), pp=smp.pp_size())))
'''


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in FOREIGN_VARS}
    env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                "PIP_DISABLE_PIP_VERSION_CHECK": "1"}, **extra)
    # One compile per core (ninja's default is cores + 2; a torch-including file needs
    # ~1.4 GB).
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
    return env


def run(cmd, timeout=300, check=True, **kw):
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                         timeout=timeout, env=kw.pop("env", clean_env()), **kw)
    if check:
        assert out.returncode == 0, (f"{' '.join(map(str, cmd))} exited {out.returncode}\n"
                                     f"--- stdout\n{out.stdout[-6000:]}\n"
                                     f"--- stderr\n{out.stderr[-6000:]}")
    return out


def site_packages(python):
    return run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
               ).stdout.strip()


def fresh_venv(path, entries=None):
    """A venv at `path` with the test environment's site-packages hard-linked into it
    (`entries` of it only, when given): no copy of torch's GBs, no download."""
    run([PYTHON, "-m", "venv", "--without-pip", path])
    src, dst = site_packages(PYTHON), site_packages(os.path.join(path, "bin", "python"))
    for name in entries if entries is not None else os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(dst, name)
        try:
            if os.path.isdir(s):
                shutil.copytree(s, d, copy_function=os.link, dirs_exist_ok=True)
            else:
                os.link(s, d)
        except OSError as e:  # another file system: a copy would cost GBs
            pytest.skip(f"cannot hard-link {src} into {dst} ({e}); set TMPDIR to a "
                        "directory on the same file system")
    return os.path.join(path, "bin", "python")


def copy_working_tree(dst):
    """The repository's files as `pip install .` of a checkout would see them: tracked and
    untracked-but-not-ignored (no build/ or .venv/), with uncommitted edits."""
    files = run(["git", "-C", REPO, "ls-files", "-z", "--cached", "--others",
                 "--exclude-standard"]).stdout.split("\0")
    for rel in filter(None, files):
        src = os.path.join(REPO, rel)
        if os.path.isfile(src):  # deleted but not yet committed: skip
            os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dst, rel))
    return dst


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    root = tmp_path_factory.mktemp("pip")
    yield root, copy_working_tree(root / "src")
    shutil.rmtree(root, ignore_errors=True)  # the venv holds hard links only, the build GBs


@pytest.fixture(scope="module")
def installed(tree):
    """(venv python, pip install seconds, pip wheel output dir): `pip install <src>`, then
    `pip wheel --no-deps <src>` on the same build directory (incremental)."""
    root, src = tree
    python = fresh_venv(root / "venv")
    run([python, "-m", "pip", "uninstall", "-y", *NOT_TORCH])
    build_dir = root / "build"
    start = time.monotonic()
    run([python, "-m", "pip", "install", src, "-C", f"build-dir={build_dir}"], timeout=3600)
    seconds = time.monotonic() - start
    print(f"pip install: {seconds:.0f} s")
    wheels = root / "wheels"
    run([python, "-m", "pip", "wheel", "--no-deps", src, "-w", wheels,
         "-C", f"build-dir={build_dir}"], timeout=3600)
    shutil.rmtree(build_dir)  # the installed smp must not lean on the build tree
    return python, seconds, wheels


def test_environment_holds_torch_only(installed):
    import torch
    python = installed[0]
    names = run([python, "-m", "pip", "list", "--format", "json"]).stdout
    names = {p["name"].lower() for p in json.loads(names)}
    assert {"torch", "smp", "numpy"} <= names, names
    assert not {"pytest", "scikit-build-core", "cmake", "ninja", "pybind11"} & names, names
    # The torch smp was built against is the linked one, not a second download.
    version = run([python, "-c", "import torch; print(torch.__version__)"]).stdout.strip()
    assert version == torch.__version__, version


def test_wheel_contents(installed):
    """Installed files (the RECORD): the two packages, smp/_C*.so and bin/smprun only;
    `pip wheel` made the same wheel."""
    python, _, wheels = installed
    site = site_packages(python)
    info = [d for d in os.listdir(site) if d.startswith("smp-") and d.endswith(".dist-info")]
    assert len(info) == 1, info
    record = [line.split(",")[0] for line in
              open(os.path.join(site, info[0], "RECORD")).read().splitlines()
              if line and "__pycache__" not in line]  # pip compiles .pyc files on install
    scripts = [p for p in record if p.startswith("../")]
    assert [os.path.normpath(os.path.join(site, p)) for p in scripts] == \
        [os.path.join(os.path.dirname(python), "smprun")], scripts
    tops = {p.split("/")[0] for p in record if p not in scripts}
    assert tops == {"smp", "smdistributed", info[0]}, tops
    assert len([p for p in record if p.startswith("smp/_C") and p.endswith(".so")]) == 1, record
    junk = [p for p in record if p.endswith((".h", ".a", ".cmake", ".o", ".cpp", ".pyc"))]
    assert not junk, junk
    assert "smdistributed/modelparallel/torch.py" in record
    assert os.access(os.path.join(os.path.dirname(python), "smprun"), os.X_OK)

    built = os.listdir(wheels)
    assert len(built) == 1 and built[0].startswith("smp-") and built[0].endswith(".whl"), built
    import zipfile
    with zipfile.ZipFile(os.path.join(wheels, built[0])) as z:
        names = [n for n in z.namelist() if not n.startswith(info[0])]
    assert sorted(n.replace("smp-0.1.0.data/scripts/", "../../../bin/") for n in names) == \
        sorted(p for p in record if not p.startswith(info[0])), names


def test_import_without_pythonpath(installed, tmp_path):
    python = installed[0]
    code = ("import importlib.metadata as md, smp, smdistributed.modelparallel as mp, "
            "smdistributed.modelparallel.torch as s; assert s is smp; smp.init(); "
            "print(smp.__file__, smp._C.__file__, smp.size(), smp.__version__, "
            "md.version('smp'), mp.__version__)")
    out = run([python, "-c", code], cwd=tmp_path).stdout.split()
    site = site_packages(python)
    assert out[0].startswith(site + "/smp/") and out[1].startswith(site + "/smp/_C"), out
    # The wheel's version (CMakeLists.txt's project VERSION) is smp.__version__.
    assert out[2] == "1" and out[3] == out[4], out


def test_two_rank_job_matches_one_process(installed, tmp_path):
    """smprun (the venv's bin/, found by path only) runs the job with the venv's python;
    a stale `make install` tree in the same prefix (<prefix>/lib/smp/python) must not
    shadow the installed smp."""
    import torch
    python = installed[0]
    smprun = os.path.join(os.path.dirname(python), "smprun")
    (tmp_path / "job.py").write_text(JOB)
    prefix = os.path.dirname(os.path.dirname(python))
    stale = os.path.join(prefix, "lib", "smp", "python", "smp")
    os.makedirs(stale)
    with open(os.path.join(stale, "__init__.py"), "w") as f:
        f.write("raise ImportError('stale make-install smp imported instead of the wheel')\n")
    try:
        job = run([smprun, "--nproc_per_node", "2", "--config",
                   '{"partitions": 2, "microbatches": 2}', "job.py", "smp"],
                  cwd=tmp_path, timeout=300).stdout
    finally:
        shutil.rmtree(os.path.join(prefix, "lib", "smp"))
    ref = run([python, "job.py", "ref"], cwd=tmp_path).stdout

    def parse(out):
        lines = [l.split("RESULT ", 1)[1] for l in out.splitlines() if "RESULT " in l]
        assert len(lines) == 1, out
        return json.loads(lines[0])

    got, want = parse(job), parse(ref)
    assert (got["size"], got["pp"]) == (2, 2), got
    site = site_packages(python)
    for exe, smp_file in got["where"]:
        assert exe == python and smp_file.startswith(site + "/smp/"), got["where"]
    owned = got["owned"]
    assert all(owned) and not set(owned[0]) & set(owned[1]), owned  # really split
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]),
                               rtol=1e-5, atol=1e-6)
    assert list(got["state"]) == list(want["state"])
    for k, v in want["state"].items():
        torch.testing.assert_close(torch.tensor(got["state"][k]), torch.tensor(v),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_without_torch_fails_fast_and_clearly(tree):
    """No torch in the environment: the build stops at CMake's torch check with the
    message naming the interpreter and what to do, and pip downloads no torch."""
    root, src = tree
    src_py = site_packages(PYTHON)
    pip = [n for n in os.listdir(src_py) if n == "pip" or
           (n.startswith("pip-") and n.endswith(".dist-info"))]
    python = fresh_venv(root / "notorch", entries=pip)
    out = run([python, "-m", "pip", "install", src], check=False, timeout=600)
    text = out.stdout + out.stderr
    words = " ".join(text.split())  # CMake wraps its message, pip indents it
    assert out.returncode != 0, text[-4000:]
    assert f"smp builds against the torch that {python} imports, and it imports none" in \
        words, text[-4000:]
    assert "`pip install torch` in your environment" in words, text[-4000:]
    assert "Collecting torch" not in text and "Downloading torch" not in text, text[-4000:]
