// Registration functions of the smp._C submodules, one per source folder.
#pragma once
#include <exception>
#include <memory>

#include <torch/csrc/utils/pybind.h>

namespace smp::python {
void bind_core(pybind11::module_& m);       // config, topology, runtime, object comm
void bind_partition(pybind11::module_& m);  // partition planner
void bind_pipeline(pybind11::module_& m);   // p2p engine of the pipeline
void bind_calls(pybind11::module_& m);      // both sides of a remote call (Caller, Server)
void bind_reducer(pybind11::module_& m);    // gradient reducer, GradBucket, comm hooks
void bind_join(pybind11::module_& m);       // Join protocol of uneven inputs (JoinProtocol)
void bind_checkpoint(pybind11::module_& m);  // checkpoint files (CheckpointError, Manifest)
void bind_powersgd(pybind11::module_& m);    // PowerSGD hook state
void bind_model(pybind11::module_& m);       // DistributedModel's checks (fingerprints)
void bind_launcher(pybind11::module_& m);    // launcher/'s SLURM parsing (smp.init under srun)
void bind_amp(pybind11::module_& m);         // loss scaler, overflow check (mixed precision)
void bind_optim(pybind11::module_& m);       // fused optimizer steps (LAMB, NovoGrad)
void bind_tp(pybind11::module_& m);          // tensor parallelism (slices, tp collectives)

// Seconds a binding's collective may wait when the caller gives none: the runtime's
// timeout_s after smp.init, else 300 (bind_reducer.cpp).
double default_timeout();

// Whether the interpreter is finalizing: an object holding Python references that
// is destroyed then must not take the GIL (bind_pipeline.cpp).
bool python_finalizing();

// A Python callable kept by C++ threads: copies share it without the GIL; the last one
// drops it with the GIL held (bind_pipeline.cpp).
using SharedFn = std::shared_ptr<pybind11::function>;
SharedFn share(pybind11::function f);

// With the GIL held: the Python exception `error` holds (its traceback set), or a
// RuntimeError with a C++ error's text (bind_calls.cpp).
pybind11::object python_exception(std::exception_ptr error);

// `p`, an object holding Python references that C++ threads may share, owned by a
// shared_ptr that deletes it with the GIL held, and leaves it be while the interpreter
// finalizes (its Python objects outlive it then).
template <typename T>
std::shared_ptr<T> python_owned(T* p) {
  return std::shared_ptr<T>(p, [](T* q) {
    if (python_finalizing()) return;
    pybind11::gil_scoped_acquire gil;
    delete q;
  });
}
}  // namespace smp::python
