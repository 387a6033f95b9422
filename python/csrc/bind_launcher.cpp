// Bindings of launcher/'s scheduler parsing, so smp.init under srun reads SLURM's
// variables with the very rules smprun uses (python/smp/launch_env.py).
#include <pybind11/stl.h>

#include "bindings.h"
#include "launcher/scheduler_env.h"

namespace py = pybind11;

namespace smp::python {

void bind_launcher(py::module_& m) {
  m.def("first_slurm_host", &launcher::first_slurm_host, py::arg("nodelist"),
        "First host of a SLURM hostlist ('node[01-04],gpu5' -> 'node01'); '' if malformed.");
  m.def("slurm_tasks_on_node", &launcher::slurm_tasks_on_node, py::arg("counts"),
        py::arg("node"),
        "Tasks on `node` from SLURM's per-node counts ('2(x3),1'); None if malformed or "
        "`node` is outside the list.");
}

}  // namespace smp::python
