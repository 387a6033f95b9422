// Bindings for DistributedModel's parts: tensor fingerprints (tied copies), the
// gradient guard (Note [Unreduced gradients] in smp_core/grad_guard.cpp) and the data-
// parallel step policy (smp._C.ReplicaStep, smp_core/replica_step.h; types only).
//
// GIL: ReplicaStep's collectives and reducer calls release it (a comm hook needs it).
#include <memory>
#include <optional>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <pybind11/stl.h>

#include "bindings.h"
#include "smp_core/fingerprint.h"
#include "smp_core/grad_guard.h"
#include "smp_core/replica_step.h"

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

  using release = py::call_guard<py::gil_scoped_release>;
  py::enum_<ForwardSync>(m, "ForwardSync", "What a forward's sync broadcasts from dp rank 0.")
      .value("nothing", ForwardSync::kNothing)
      .value("buffers", ForwardSync::kBuffers)
      .value("state", ForwardSync::kState);
  py::enum_<StepFailure>(m, "StepFailure", "What ReplicaStep.fail_step did.")
      .value("nothing", StepFailure::kNothing)
      .value("posted", StepFailure::kPosted)
      .value("abandoned", StepFailure::kAbandoned)
      .value("failed", StepFailure::kFailed);
  py::class_<ReplicaStep>(m, "ReplicaStep",
      "The data-parallel step policy of one replica (smp_core/replica_step.h).")
      .def(py::init([](const ProcessGroupPtr& pg, bool reduces, bool broadcast_buffers,
                       int64_t backward_passes_per_step, std::optional<double> timeout_s) {
             ReplicaStepOptions o;
             o.reduces = reduces;
             o.broadcast_buffers = broadcast_buffers;
             o.backward_passes_per_step = backward_passes_per_step;
             o.timeout_s = timeout_s ? *timeout_s : default_timeout();
             return std::make_unique<ReplicaStep>(pg, o);
           }),
           py::arg("process_group"), py::arg("reduces"), py::arg("broadcast_buffers"),
           py::arg("backward_passes_per_step"), py::arg("timeout_s") = py::none())
      .def("forward_sync", &ReplicaStep::forward_sync, py::arg("has_buffers"))
      .def("sync_before_forward",
           [](ReplicaStep& s, const std::vector<at::Tensor>& params,
              const std::vector<at::Tensor>& buffers, const std::vector<int>& sliced,
              const py::object& slice_group) {
             ProcessGroupPtr g;
             if (!slice_group.is_none()) g = slice_group.cast<ProcessGroupPtr>();
             py::gil_scoped_release nogil;
             return s.sync_before_forward(params, buffers, sliced, g);
           },
           py::arg("params"), py::arg("buffers"), py::arg("sliced") = std::vector<int>{},
           py::arg("slice_group") = py::none())
      .def("steps", &ReplicaStep::steps)
      .def("next_step_syncs", &ReplicaStep::next_step_syncs)
      .def("begin_step", &ReplicaStep::begin_step)
      .def("set_sync_step", &ReplicaStep::set_sync_step, py::arg("sync"))
      .def("sync_step", &ReplicaStep::sync_step)
      .def("begin_microbatch", &ReplicaStep::begin_microbatch, py::arg("last"))
      .def("prepare_for_backward", &ReplicaStep::prepare_for_backward, py::arg("reducer"),
           py::arg("outputs"), release())
      .def("armed", &ReplicaStep::armed)
      .def("end_step", [](ReplicaStep& s, Reducer* reducer) { s.end_step(reducer); },
           py::arg("reducer"), release())
      .def("set_failure_post", &ReplicaStep::set_failure_post, py::arg("store"),
           py::arg("prefix"), py::arg("rank"), py::arg("dp_rank"))
      .def("fail_step", &ReplicaStep::fail_step, py::arg("reducer"), py::arg("sync_step"),
           py::arg("armed"), py::arg("error"), release());
}

}  // namespace smp::python
