# pip's torch (a CUDA build) links the CUDA, cuDNN and NCCL libraries of its nvidia-*
# wheels, newer than a CUDA toolkit's (libtorch_cuda.so needs ncclCommGrow, ...): the
# linker must resolve them there, not in /usr/local/cuda. Included after
# find_package(Torch) by smp's own build (for every target) and by smpConfig.cmake (on
# smp::core's interface), so that programs linking smp link too. Sets
# SMP_TORCH_LINK_OPTIONS; empty for a torch without nvidia-* wheels (Debian's, a CPU build).
get_filename_component(_smp_torch_lib_dir "${TORCH_LIBRARY}" DIRECTORY)
file(GLOB _smp_nvidia_lib_dirs "${_smp_torch_lib_dir}/../../nvidia/*/lib")
set(SMP_TORCH_LINK_OPTIONS)
foreach(_smp_dir ${_smp_nvidia_lib_dirs})
  get_filename_component(_smp_dir "${_smp_dir}" REALPATH)
  list(APPEND SMP_TORCH_LINK_OPTIONS "LINKER:-rpath-link,${_smp_dir}")
endforeach()
unset(_smp_torch_lib_dir)
unset(_smp_nvidia_lib_dirs)
unset(_smp_dir)
