"""smp._C.build_info(): a CUDA torch gets smp's CUDA/NCCL path compiled and linked.

The CUDA assertions run only when the torch found has CUDA and NCCL (pip's torch does;
no GPU is needed: the code is compiled and linked, not run). On a CPU-only torch they
are skipped and the CPU build must report no CUDA path.
"""
import glob
import os
import shutil
import subprocess

import pytest
import torch
import torch.distributed as dist

import smp

TORCH_HAS_CUDA = torch.version.cuda is not None and dist.is_nccl_available()
BUILD_DIR = os.environ.get("SMP_BUILD_DIR", "build")


def _module_path():
    return smp._C.__file__


def test_build_info_names_the_torch_it_compiled_against():
    info = smp._C.build_info()
    assert set(info) == {"torch_version", "cuda", "nccl", "cuda_paths"}
    assert torch.__version__.startswith(info["torch_version"]), (info, torch.__version__)


@pytest.mark.skipif(TORCH_HAS_CUDA, reason="torch has CUDA")
def test_cpu_torch_compiles_no_cuda_path():
    info = smp._C.build_info()
    assert info["cuda"] is False and info["nccl"] is False and info["cuda_paths"] == []


@pytest.mark.skipif(not TORCH_HAS_CUDA, reason="torch has no CUDA/NCCL")
def test_cuda_torch_compiles_the_cuda_paths():
    info = smp._C.build_info()
    assert info["cuda"] is True, info
    assert info["nccl"] is True, info
    for name in ("cuda_streams", "cuda_record_stream", "cuda_tensors_p2p",
                 "cuda_map_location", "nccl_groups"):
        assert name in info["cuda_paths"], (name, info)


@pytest.mark.skipif(not TORCH_HAS_CUDA, reason="torch has no CUDA/NCCL")
@pytest.mark.skipif(shutil.which("nm") is None, reason="no nm")
def test_cuda_functions_are_linked_into_the_module():
    # The names in smp_core/cuda/cuda_paths.cpp, each calling into libc10_cuda.
    out = subprocess.run(["nm", "-C", "--defined-only", _module_path()],
                         capture_output=True, text=True, check=True).stdout
    for fn in ("smp::device::cuda::current_stream_id", "smp::device::cuda::device_count",
               "smp::device::cuda::compiled_paths"):
        assert fn in out, f"{fn} not defined in {_module_path()}"
    # The module depends on libc10_cuda (the CUDA calls resolve there).
    ldd = subprocess.run(["ldd", _module_path()], capture_output=True, text=True).stdout
    libs = glob.glob(os.path.join(BUILD_DIR, "smp_core", "libsmp_core.a"))
    if libs:
        archive = subprocess.run(["nm", "-C", "--defined-only", libs[0]],
                                 capture_output=True, text=True, check=True).stdout
        assert "smp::device::cuda::current_stream_id" in archive
    assert "c10_cuda" in ldd or "c10::cuda" in subprocess.run(
        ["nm", "-C", "--undefined-only", _module_path()],
        capture_output=True, text=True).stdout
