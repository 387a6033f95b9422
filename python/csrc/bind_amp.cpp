// smp._C's mixed precision: the loss scaler and the job-wide overflow check (Note [One
// overflow decision] in smp_core/loss_scale.cpp). smp/mixed_precision.py drives them.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <pybind11/stl.h>

#include "bindings.h"
#include "smp_core/loss_scale.h"

namespace py = pybind11;

namespace smp::python {

void bind_amp(py::module_& m) {
  using State = LossScaler::State;
  py::class_<LossScaler>(m, "LossScaler")
      .def_static("fixed", &LossScaler::fixed, py::arg("scale"))
      .def_static("dynamic", &LossScaler::dynamic, py::arg("args"))
      .def_property_readonly("dynamic_scaling", &LossScaler::is_dynamic)
      .def_property_readonly("scale", &LossScaler::scale)
      .def("update", &LossScaler::update, py::arg("overflow"))
      .def("options", [](const LossScaler& s) {
        const auto& o = s.options();
        py::dict d;
        d["init_scale"] = o.init_scale;
        d["scale_factor"] = o.scale_factor;
        d["scale_window"] = o.scale_window;
        d["min_scale"] = o.min_scale;
        d["delayed_shift"] = o.delayed_shift;
        d["consecutive_hysteresis"] = o.consecutive_hysteresis;
        return d;
      })
      // (scale, iter, last_overflow_iter, hysteresis): what a checkpoint keeps.
      .def("state", [](const LossScaler& s) {
        State st = s.state();
        return py::make_tuple(st.scale, st.iter, st.last_overflow_iter, st.hysteresis);
      })
      .def("set_state", [](LossScaler& s, double scale, int64_t iter, int64_t last, int64_t h) {
        s.set_state(State{scale, iter, last, h});
      }, py::arg("scale"), py::arg("iter"), py::arg("last_overflow_iter"), py::arg("hysteresis"));

  py::class_<OverflowCheck, std::shared_ptr<OverflowCheck>>(m, "OverflowCheck")
      .def(py::init([](std::vector<at::Tensor> params, std::optional<ProcessGroupPtr> group,
                       double timeout_s) {
             return std::make_shared<OverflowCheck>(std::move(params),
                                                    group ? *group : ProcessGroupPtr(),
                                                    timeout_s);
           }),
           py::arg("params"), py::arg("group"), py::arg("timeout_s"))
      .def("run", &OverflowCheck::run, py::call_guard<py::gil_scoped_release>())
      .def("last", &OverflowCheck::last)
      .def("take", &OverflowCheck::take)
      .def_property_readonly("runs", &OverflowCheck::runs)
      .def_static("any_nonfinite", &OverflowCheck::any_nonfinite, py::arg("grads"));
}

}  // namespace smp::python
