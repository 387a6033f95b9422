"""What the torch under test does as smp's peer: the tests' one place for torch-version
differences (smp's own are in smp_core/compat/ and smp/checkpoint/_torch_load.py).

Imported by test modules and by rank scripts (tests/python is on the ranks' PYTHONPATH).
Each fact was measured on these machines with Debian's torch 1.13.1 and pip's 2.15.0 on
Gloo CPU ranks; a comparison that torch cannot run is skipped only where its fact says so.
"""
import torch

__all__ = ["TORCH_2", "LOAD_DEFAULTS_TO_WEIGHTS_ONLY", "TORCHRUN_C10D_RDZV_USES_AGENT_STORE",
           "QUANTIZATION_HOOKS_RUN_ON_GLOO", "BF16_ON_GLOO", "POWERSGD_MANY_BUCKETS_ON_GLOO",
           "DDP_FIRST_BUCKET_FOLLOWS_CAP", "quantization_helper", "ddp_bucketed_as_smp"]

TORCH_2 = torch.__version__ >= "2"

# torch.load(f) without pickle_module unpickles weights only (torch >= 2.6).
LOAD_DEFAULTS_TO_WEIGHTS_ONLY = torch.__version__ >= "2.6"

# torchrun --rdzv_backend c10d sets TORCHELASTIC_USE_AGENT_STORE=True for its workers
# (1.13: False, the workers open their own store).
TORCHRUN_C10D_RDZV_USES_AGENT_STORE = TORCH_2

# torch's quantization_pertensor/perchannel hooks run on CPU tensors over Gloo (1.13:
# they call .cuda() and index the allgather's list of tensors as one stacked tensor).
# Their second allgather is issued from a future callback, so with several buckets they
# are compared awaited (each bucket's chain done before the next), as PowerSGD.
QUANTIZATION_HOOKS_RUN_ON_GLOO = TORCH_2

# Gloo reduces bfloat16 tensors (torch's bf16_compress_hook; 1.13's Gloo refuses them).
BF16_ON_GLOO = TORCH_2

# torch's powerSGD_hook with two or more buckets on Gloo: aborts (gloo EnforceNotMet)
# or hangs, in 1.13 (FACTS.md) and in 2.15 (0 of 3 runs survive, bench/powersgd.py
# --probe-many-buckets), because it chains collectives from Gloo's callback threads.
# Compared awaited or with one bucket instead.
POWERSGD_MANY_BUCKETS_ON_GLOO = False

# torch DDP given bucket_cap_mb caps its first bucket at that size too (2.x), as smp does;
# 1.13 caps the first bucket at dist._DEFAULT_FIRST_BUCKET_BYTES (1 MB) whatever
# bucket_cap_mb says, so at bucket_cap_mb=0.001 tests/python/nets.Net stays one bucket
# after the rebuild (smp and 2.15: 3). Per-bucket hooks (PowerSGD draws its random Q per
# bucket) then differ. 1.13's DDP reads that knob once, at construction ("User can set
# dist._DEFAULT_FIRST_BUCKET_BYTES to tune DDP first bucket"): ddp_bucketed_as_smp sets it.
DDP_FIRST_BUCKET_FOLLOWS_CAP = TORCH_2


def quantization_helper(quantization_hooks, op, kind):
    """torch's `_{op}_{kind}` helper of quantization_hooks (op: quantize | dequantize,
    kind: per_tensor | per_channel): `*_backend` in torch 2.x, `*_cuda` in 1.13."""
    suffix = "backend" if TORCH_2 else "cuda"
    return getattr(quantization_hooks, f"_{op}_{kind}_{suffix}")


def ddp_bucketed_as_smp(module, bucket_cap_mb, **kw):
    """torch DDP over `module` whose buckets are those of smp.DistributedModel with the same
    bucket_cap_mb (first bucket included, DDP_FIRST_BUCKET_FOLLOWS_CAP); `kw` go to DDP."""
    import torch.distributed as dist
    ddp = torch.nn.parallel.DistributedDataParallel
    if DDP_FIRST_BUCKET_FOLLOWS_CAP:
        return ddp(module, bucket_cap_mb=bucket_cap_mb, **kw)
    saved = dist._DEFAULT_FIRST_BUCKET_BYTES
    dist._DEFAULT_FIRST_BUCKET_BYTES = int(bucket_cap_mb * 1024 * 1024)  # as 1.13's DDP rounds
    try:
        return ddp(module, bucket_cap_mb=bucket_cap_mb, **kw)
    finally:
        dist._DEFAULT_FIRST_BUCKET_BYTES = saved
