// Bindings for DistributedModel's checks: tensor fingerprints (tied copies).
#include <pybind11/stl.h>

#include "bindings.h"
#include "smp_core/fingerprint.h"

namespace py = pybind11;

namespace smp::python {

void bind_model(py::module_& m) {
  m.def("fingerprints", [](const std::vector<at::Tensor>& tensors) {
    std::vector<int64_t> out;
    out.reserve(tensors.size());
    for (const auto& t : tensors) out.push_back(static_cast<int64_t>(fingerprint(t)));
    return out;
  }, py::arg("tensors"), py::call_guard<py::gil_scoped_release>(),
     "XXH3-64 of each tensor's bytes (as int64), for comparing copies across ranks.");
}

}  // namespace smp::python
