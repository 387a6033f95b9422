"""Install: `cmake --install` to a temporary prefix, then build and run a standalone C++
program against it with find_package(smp), and install the Python packages with
tools/install_python.py. Uses the build in SMP_BUILD_DIR (default <repo>/build).
"""
import os
import re
import shutil
import subprocess

import pytest

from conftest import BUILD, PYTHON, REPO

pytestmark = pytest.mark.skipif(not os.path.isdir(BUILD),
                                reason=f"no build dir {BUILD} (run `make build`)")

CONSUMER = os.path.join(REPO, "tests", "cpp", "consumer")
# Launcher/rank variables that would turn the bare run into a rank of some other job.
JOB_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
            "MASTER_ADDR", "MASTER_PORT", "SMP_CONFIG", "SM_HP_MP_PARAMETERS")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in JOB_VARS}
    env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}, **extra)
    return env


def run(cmd, timeout=300, **kw):
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                         timeout=timeout, env=kw.pop("env", clean_env()), **kw)
    assert out.returncode == 0, (f"{' '.join(map(str, cmd))} exited {out.returncode}\n"
                                 f"--- stdout\n{out.stdout[-4000:]}\n--- stderr\n{out.stderr[-4000:]}")
    return out.stdout


def build_consumer(build_dir, *cmake_args):
    """Configures and builds tests/cpp/consumer; returns (binary, configure output)."""
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    log = run(["cmake", "-S", CONSUMER, "-B", build_dir, *gen, "-DCMAKE_BUILD_TYPE=Release",
               *cmake_args])
    run(["cmake", "--build", build_dir, "-j", "2"])
    return os.path.join(build_dir, "smp_consumer"), log


def fields(stdout):
    """'key: value' lines -> {key: value} (the consumer's output format)."""
    return dict(line.split(": ", 1) for line in stdout.splitlines() if ": " in line)


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    p = tmp_path_factory.mktemp("prefix")
    run(["cmake", "--install", BUILD, "--prefix", p])
    yield p
    shutil.rmtree(p, ignore_errors=True)  # pytest keeps old tmp dirs; an install is big


@pytest.fixture(scope="module")
def consumer(prefix, tmp_path_factory):
    binary, log = build_consumer(tmp_path_factory.mktemp("consumer"),
                                 f"-DCMAKE_PREFIX_PATH={prefix}")
    # find_package found the installed copy, not the build tree or /usr/local.
    assert f"from {prefix}/lib/cmake/smp" in log, log
    return binary


def test_installed_layout(prefix):
    for f in ["include/smp/smp.h", "include/smp/smp_core/config.h",
              "include/smp/smp_core/runtime.h", "include/smp/partition/partition.h",
              "lib/libsmp_core.a", "lib/libsmp_partition.a", "lib/cmake/smp/smpConfig.cmake",
              "lib/cmake/smp/smpConfigVersion.cmake", "lib/cmake/smp/smpTargets.cmake",
              "bin/smprun"]:
        assert (prefix / f).is_file(), f"{f} not installed under {prefix}"
    assert os.access(prefix / "bin" / "smprun", os.X_OK)
    # Internals stay out of the public include tree.
    assert not list((prefix / "include").rglob("detail")), "detail/ headers were installed"
    # The umbrella header stays free of torch's big header (STYLE.md, Headers).
    assert "#include <torch/torch.h>" not in (prefix / "include/smp/smp.h").read_text()


def quoted_includes(path):
    """The `#include "..."` targets of a header, in order."""
    with open(path) as f:
        return re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read(), re.M)


def test_umbrella_header_is_fixed_and_installed(prefix, consumer):
    """smp.h names a fixed list of headers (no __has_include, which would drop a
    missing one silently and shrink the API), every one of them is installed, and so is
    every smp header they include in turn; the `consumer` fixture compiled against them."""
    include = prefix / "include" / "smp"
    umbrella = include / "smp.h"
    assert "__has_include" not in umbrella.read_text(), \
        "smp.h must include its headers unconditionally (STYLE.md, Owners and plans)"
    direct = quoted_includes(umbrella)
    # The same list as the source tree's smp.h, each of them a header of this repo.
    assert direct == quoted_includes(os.path.join(REPO, "include", "smp", "smp.h"))
    for h in direct:
        assert os.path.isfile(os.path.join(REPO, h)), f"smp.h includes {h}, not in the sources"
    seen, todo, missing = set(), list(direct), []
    while todo:
        h = todo.pop()
        if h in seen or not os.path.isfile(os.path.join(REPO, h)):
            continue  # a third-party header, found through the targets' include paths
        seen.add(h)
        if not (include / h).is_file():
            missing.append(h)
            continue
        todo.extend(quoted_includes(include / h))
    assert not missing, f"headers smp.h needs but not installed under {include}: {sorted(missing)}"
    assert not [h for h in seen if "/detail/" in h], sorted(seen)
    # The consumer compiled smp.h and calls into its parts (hooks included).
    assert fields(run([consumer]))["builtin_hooks"] == "10"


def test_installed_python_package(prefix):
    """lib/smp/python (the package the installed smprun puts on PYTHONPATH) holds the
    packages only, not the build dir's CMake files (~650 MB with the precompiled header)."""
    root = prefix / "lib" / "smp" / "python"
    assert (root / "smp" / "__init__.py").is_file()
    assert (root / "smdistributed" / "modelparallel" / "torch.py").is_file()
    assert list((root / "smp").glob("_C*.so")), "smp._C not installed"
    junk = sorted(str(p.relative_to(root)) for p in root.iterdir()
                  if p.name not in ("smp", "smdistributed"))
    assert not junk, (f"build artifacts installed into {root}: {junk}; the install(DIRECTORY) "
                      "rule in python/CMakeLists.txt must keep to the two packages")


def test_consumer_world_of_one(consumer):
    out = run([consumer])
    f = fields(out)
    assert f["config_error"] == \
        "smp: config 'pipeline'='gpipe' is not one of {interleaved, simple, 1f1b, zero_bubble}", out
    assert f["rank"] == "0 world=1 pp_rank=0 pp_size=1 dp_rank=0 dp_size=1", out
    assert f["config"].startswith('{"active_microbatches":3,"auto_partition":true,'), out
    assert '"partitions":1' in f["config"] and '"memory_weight":0.2' in f["config"], out
    assert (f["allgather"], f["ring"], f["plan"]) == ("0", "hello from 0", "0 0 0 0"), out


def test_consumer_config_argument(consumer):
    out = run([consumer, '{"optimize": "memory", "ddp": true}'])
    cfg = fields(out)["config"]
    assert '"ddp":true' in cfg and '"memory_weight":0.8' in cfg, out


def test_consumer_ranks_under_smprun(consumer, prefix):
    """Two C++ ranks started by the installed launcher: partitions=2 -> pp ranks 0 and 1."""
    out = run([prefix / "bin" / "smprun", "--nproc_per_node", "2", "--config",
               '{"partitions": 2}', consumer], timeout=120)
    per_rank = {r: fields("\n".join(line[len(f"[{r}] "):] for line in out.splitlines()
                                    if line.startswith(f"[{r}] ")))
                for r in (0, 1)}
    for r in (0, 1):
        f = per_rank[r]
        assert f["rank"] == f"{r} world=2 pp_rank={r} pp_size=2 dp_rank=0 dp_size=1", out
        assert '"partitions":2' in f["config"], out
        assert f["allgather"] == "0,1", out
        assert f["ring"] == f"hello from {1 - r}", out
        assert f["plan"] == "0 0 1 1", out
    assert per_rank[0]["topology"] == "world=2 pp=2 dp=1: 0(pp0,dp0) 1(pp1,dp0)", out


def test_build_tree_package(tmp_path):
    """find_package(smp) also works on the build tree itself (smp_DIR=<build>)."""
    binary, log = build_consumer(tmp_path / "c", f"-Dsmp_DIR={BUILD}")
    assert f"from {BUILD}" in log, log
    assert fields(run([binary]))["rank"].startswith("0 world=1"), log


def test_install_python(tmp_path):
    """install_python.py copies the two packages, nothing else, and can be re-run."""
    site = tmp_path / "site"
    tool = os.path.join(REPO, "tools", "install_python.py")
    src = os.path.join(BUILD, "python")
    run([PYTHON, tool, src, "--target", site])
    (site / "smp" / "stale.py").write_text("# dropped from the build\n")
    run([PYTHON, tool, src, "--target", site])
    assert not (site / "smp" / "stale.py").exists(), "re-install kept a stale file"
    assert sorted(p.name for p in site.iterdir()) == ["smdistributed", "smp"]
    assert not [p for p in site.rglob("*") if p.suffix in (".o", ".gch", ".cmake")]
    code = ("import smp, smdistributed.modelparallel as mp, smdistributed.modelparallel.torch"
            " as s; assert s is smp; smp.init(); print(smp.__file__, smp.size(), mp.__version__,"
            " smp.__version__)")
    out = run([PYTHON, "-c", code], cwd=tmp_path, env=clean_env(PYTHONPATH=str(site)))
    path, size, api_level, version = out.split()
    # smdistributed.modelparallel reports the SMP API level; smp.__version__ is smp's own.
    assert path.startswith(str(site)) and size == "1", out
    assert (api_level, version) == ("1.10.0", "0.1.0"), out
