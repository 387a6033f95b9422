// Bindings for DistributedModel's checks: tensor fingerprints (tied copies) and the
// gradient guard (Note [Unreduced gradients] in smp_core/grad_guard.cpp).
#include <memory>

#include <pybind11/stl.h>

#include "bindings.h"
#include "smp_core/fingerprint.h"
#include "smp_core/grad_guard.h"

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

  py::class_<GradGuard>(m, "GradGuard")
      .def(py::init([](const std::vector<std::pair<std::string, at::Tensor>>& params,
                       bool serving_rank, py::function raise) {
             // raise(name, in_step) raises the Python error. It reaches the caller of
             // backward() with its type, through autograd's engine as python_error.
             auto fn = std::shared_ptr<py::function>(
                 new py::function(std::move(raise)), [](py::function* f) {
                   py::gil_scoped_acquire gil;
                   delete f;
                 });
             return std::make_unique<GradGuard>(
                 params, serving_rank, [fn](const std::string& name, bool in_step) {
                   py::gil_scoped_acquire gil;
                   try {
                     (*fn)(name, in_step);
                   } catch (py::error_already_set& e) {
                     e.restore();
                     python_error err;
                     err.persist();
                     throw err;
                   }
                 });
           }),
           py::arg("params"), py::arg("serving_rank"), py::arg("raise_error"),
           "Hooks each (name, parameter)'s gradient accumulator; a gradient outside "
           "enter()/exit() (and, on a serving rank, outside a step) calls raise_error.")
      .def("enter", &GradGuard::enter)
      .def("exit", &GradGuard::exit)
      .def_property("in_step", &GradGuard::in_step, &GradGuard::set_in_step)
      .def("remove", &GradGuard::remove)
      .def("__len__", &GradGuard::size);
}

}  // namespace smp::python
