// smp._C.PowerSGDState: the C++ state of the PowerSGD hooks (hooks/powersgd.h). The
// Python class smp.ddp_comm_hooks.powerSGD_hook.PowerSGDState holds one as `_native`
// and presents torch's PowerSGDState API around it; the hooks themselves are the
// BuiltinHook objects "powerSGD" and "batched_powerSGD" (bind_reducer.cpp).
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <pybind11/stl.h>

#include "bindings.h"
#include "hooks/powersgd.h"
#include "smp_core/errors.h"
#include "smp_core/runtime.h"

namespace py = pybind11;

namespace smp::python {
namespace {

using hooks::PowerSGDOptions;
using hooks::PowerSGDSnapshot;
using hooks::PowerSGDState;

py::dict tensors_dict(const std::map<int64_t, at::Tensor>& m, bool clone) {
  py::dict d;
  for (const auto& [k, t] : m) d[py::int_(k)] = clone ? t.clone() : t;
  return d;
}

std::map<int64_t, at::Tensor> tensors_map(const py::handle& obj, const char* key) {
  std::map<int64_t, at::Tensor> m;
  if (obj.is_none()) return m;
  for (const auto& [k, v] : obj.cast<py::dict>()) {
    if (!THPVariable_Check(v.ptr()))
      throw ConfigError(str_cat("smp: PowerSGDState.load_state_dict: ", key, "[",
                                py::str(k).cast<std::string>(), "] is not a Tensor"));
    m[k.cast<int64_t>()] = THPVariable_Unpack(v.ptr());
  }
  return m;
}

// The options as torch's field names (plus random_seed and timeout_s).
void put_options(py::dict& d, const PowerSGDOptions& o) {
  d["matrix_approximation_rank"] = o.matrix_approximation_rank;
  d["start_powerSGD_iter"] = o.start_powerSGD_iter;
  d["min_compression_rate"] = o.min_compression_rate;
  d["use_error_feedback"] = o.use_error_feedback;
  d["warm_start"] = o.warm_start;
  d["orthogonalization_epsilon"] = o.orthogonalization_epsilon;
  d["random_seed"] = o.random_seed;
  d["compression_stats_logging_frequency"] = o.compression_stats_logging_frequency;
  d["batch_tensors_with_same_shape"] = o.batch_tensors_with_same_shape;
  d["timeout_s"] = o.timeout_s;
}

template <typename T>
void get_opt(const py::dict& d, const char* key, T& out) {
  if (d.contains(key)) out = d[key].cast<T>();
}

py::object item(const py::dict& d, const char* key) {
  return d.contains(key) ? py::object(d[key]) : py::object(py::none());
}

}  // namespace

void bind_powersgd(py::module_& m) {
  py::class_<PowerSGDState, std::shared_ptr<PowerSGDState>>(m, "PowerSGDState",
      "C++ state of the PowerSGD hooks; use smp.ddp_comm_hooks.powerSGD_hook.PowerSGDState.")
      .def(py::init([](py::object pg, int64_t rank, int64_t start, double rate, bool ef,
                       bool warm, double eps, uint32_t seed, int64_t freq, bool batch,
                       std::optional<double> timeout_s) {
             PowerSGDOptions o;
             o.matrix_approximation_rank = rank;
             o.start_powerSGD_iter = start;
             o.min_compression_rate = rate;
             o.use_error_feedback = ef;
             o.warm_start = warm;
             o.orthogonalization_epsilon = eps;
             o.random_seed = seed;
             o.compression_stats_logging_frequency = freq;
             o.batch_tensors_with_same_shape = batch;
             o.timeout_s = timeout_s ? *timeout_s : default_timeout();
             ProcessGroupPtr g = pg.is_none() ? ProcessGroupPtr() : pg.cast<ProcessGroupPtr>();
             return std::make_shared<PowerSGDState>(o, g);
           }),
           py::arg("process_group"), py::arg("matrix_approximation_rank"),
           py::arg("start_powerSGD_iter"), py::arg("min_compression_rate"),
           py::arg("use_error_feedback"), py::arg("warm_start"),
           py::arg("orthogonalization_epsilon"), py::arg("random_seed"),
           py::arg("compression_stats_logging_frequency"),
           py::arg("batch_tensors_with_same_shape"), py::arg("timeout_s") = py::none())
      .def_property("process_group", &PowerSGDState::process_group,
                    [](PowerSGDState& s, py::object pg) {
                      s.set_process_group(pg.is_none() ? ProcessGroupPtr()
                                                       : pg.cast<ProcessGroupPtr>());
                    })
      .def("set_timeout", &PowerSGDState::set_timeout, py::arg("timeout_s"))
      .def("iter", &PowerSGDState::iter)
      .def("compression_stats", &PowerSGDState::compression_stats)
      .def("bytes_allreduced", &PowerSGDState::bytes_allreduced,
           "Bytes this rank gave to the hooks' collectives so far (all steps).")
      .def("stats_reports", &PowerSGDState::stats_reports)
      .def("options", [](const PowerSGDState& s) {
        py::dict d;
        put_options(d, s.options());
        return d;
      })
      .def("snapshot", [](const PowerSGDState& s, bool clone) {
        PowerSGDSnapshot snap = s.snapshot();
        py::dict d;
        put_options(d, snap.options);
        d["rng_key"] = snap.rng_key;
        d["rng_pos"] = snap.rng_pos;
        d["iter"] = snap.iter;
        d["total_numel_before_compression"] = snap.total_numel_before_compression;
        d["total_numel_after_compression"] = snap.total_numel_after_compression;
        d["next_stats_report"] = snap.next_stats_report;
        d["error_dict"] = tensors_dict(snap.error_dict, clone);
        d["p_memory_dict"] = tensors_dict(snap.p_memory_dict, clone);
        d["q_memory_dict"] = tensors_dict(snap.q_memory_dict, clone);
        return d;
      }, py::arg("clone") = true,
         "The state as a dict (torch's field names; the rng as numpy's MT19937 key and "
         "position). clone=True copies the tensors.")
      .def("restore", [](PowerSGDState& s, const py::dict& d) {
        PowerSGDSnapshot snap;
        snap.options = s.options();
        get_opt(d, "matrix_approximation_rank", snap.options.matrix_approximation_rank);
        get_opt(d, "start_powerSGD_iter", snap.options.start_powerSGD_iter);
        get_opt(d, "min_compression_rate", snap.options.min_compression_rate);
        get_opt(d, "use_error_feedback", snap.options.use_error_feedback);
        get_opt(d, "warm_start", snap.options.warm_start);
        get_opt(d, "orthogonalization_epsilon", snap.options.orthogonalization_epsilon);
        get_opt(d, "random_seed", snap.options.random_seed);
        get_opt(d, "compression_stats_logging_frequency",
                snap.options.compression_stats_logging_frequency);
        get_opt(d, "batch_tensors_with_same_shape", snap.options.batch_tensors_with_same_shape);
        get_opt(d, "timeout_s", snap.options.timeout_s);
        snap.rng_key = d["rng_key"].cast<std::vector<uint32_t>>();
        snap.rng_pos = d["rng_pos"].cast<int64_t>();
        get_opt(d, "iter", snap.iter);
        get_opt(d, "total_numel_before_compression", snap.total_numel_before_compression);
        get_opt(d, "total_numel_after_compression", snap.total_numel_after_compression);
        get_opt(d, "next_stats_report", snap.next_stats_report);
        snap.error_dict = tensors_map(item(d, "error_dict"), "error_dict");
        snap.p_memory_dict = tensors_map(item(d, "p_memory_dict"), "p_memory_dict");
        snap.q_memory_dict = tensors_map(item(d, "q_memory_dict"), "q_memory_dict");
        s.restore(snap);
      }, py::arg("state"));
}

}  // namespace smp::python
