// smp._C: the C++ core of smp. `import torch` must precede this import (the torch
// pybind11 types it uses are registered by torch).
#include "bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "smp C++ core";
  smp::python::bind_core(m);
  smp::python::bind_pipeline(m);
  smp::python::bind_calls(m);
  smp::python::bind_reducer(m);
  smp::python::bind_join(m);
  smp::python::bind_powersgd(m);
  smp::python::bind_model(m);
  smp::python::bind_tp(m);
  smp::python::bind_launcher(m);
  smp::python::bind_amp(m);
  smp::python::bind_optim(m);
#ifdef SMP_HAVE_SMP_PARTITION
  smp::python::bind_partition(m);
#endif
#ifdef SMP_HAVE_SMP_CHECKPOINT
  smp::python::bind_checkpoint(m);
#endif
}
