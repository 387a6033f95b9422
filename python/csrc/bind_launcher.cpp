// Bindings of launcher/'s scheduler parsing and smp_common's launch defaults, so
// smp.init under srun or mpirun reads the environment with the very rules and defaults
// smprun uses (python/smp/launch_env.py).
#include <pybind11/stl.h>

#include "bindings.h"
#include "launcher/scheduler_env.h"
#include "smp_common/env.h"

namespace py = pybind11;

namespace smp::python {

void bind_launcher(py::module_& m) {
  m.def("first_slurm_host", &launcher::first_slurm_host, py::arg("nodelist"),
        "First host of a SLURM hostlist ('node[01-04],gpu5' -> 'node01'); '' if malformed.");
  m.def("slurm_tasks_on_node", &launcher::slurm_tasks_on_node, py::arg("counts"),
        py::arg("node"),
        "Tasks on `node` from SLURM's per-node counts ('2(x3),1'); None if malformed or "
        "`node` is outside the list.");
  m.attr("DEFAULT_MASTER_PORT") = common::kDefaultMasterPort;
}

}  // namespace smp::python
