"""smp's default allocator setting as the environment of a bench's processes, so the
torch peer runs under the same one (fairness: docs/benchmarks.md). Note [Fixed mmap
threshold] in smp_core/runtime.h: smp.init fixes glibc's mmap threshold at 4 MiB and its
trim threshold at 4 x that; these variables set the same for every process, and a
job's own setting of them wins over smp.init's."""

SMP_DEFAULT = {"MALLOC_MMAP_THRESHOLD_": "4194304", "MALLOC_TRIM_THRESHOLD_": "16777216"}
