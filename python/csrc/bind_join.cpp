// Bindings of the Join protocol: smp._C.JoinProtocol, the collectives of the Join
// context (smp_core/join.h; python/smp/join.py drives them). See docs/join.md.
//
// GIL: every collective releases it (a peer's comm hook may need it meanwhile).
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <pybind11/stl.h>

#include <optional>

#include "bindings.h"
#include "smp_core/join.h"
#include "smp_core/join_step.h"
#include "smp_core/reducer.h"

namespace py = pybind11;

namespace smp::python {

void bind_join(py::module_& m) {
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<JoinProtocol, std::shared_ptr<JoinProtocol>>(m, "JoinProtocol",
      "The Join context's collectives on one process group (smp_core/join.h).")
      .def(py::init([](const ProcessGroupPtr& pg, std::optional<double> timeout_s,
                       const std::string& group_name) {
             return std::make_shared<JoinProtocol>(pg, timeout_s ? *timeout_s : default_timeout(),
                                                   group_name);
           }),
           py::arg("process_group"), py::arg("timeout_s") = py::none(),
           py::arg("group_name") = "dp")
      .def("set_replicas", &JoinProtocol::set_replicas, py::arg("replica_of"),
           py::arg("tp_degree"),
           "Note [Join under tensor parallelism] (smp_core/join.cpp): the replica of each "
           "group rank; a replica whose ranks join apart raises ConfigError on every rank.")
      .def("notify_not_joined", &JoinProtocol::notify_not_joined, release())
      .def("count_not_joined", &JoinProtocol::count_not_joined, release())
      .def("check_early_termination", &JoinProtocol::check_early_termination,
           py::arg("joined"), release())
      .def("find_common_rank", &JoinProtocol::find_common_rank, py::arg("candidate"), release())
      .def("allreduce_sum", &JoinProtocol::allreduce_sum, py::arg("value"), py::arg("what"),
           release())
      .def_property_readonly("iteration", &JoinProtocol::iteration)
      .def_property_readonly("rank", &JoinProtocol::rank)
      .def_property_readonly("size", &JoinProtocol::size)
      .def_property_readonly("process_group", &JoinProtocol::process_group);

  // Note [Join step] (smp_core/join_step.cpp): a model's part of each Join iteration.
  m.def("join_announce_step", &join_announce_step, py::arg("proto"), py::arg("reducer"),
        py::arg("sync_step"), py::arg("divide_by_initial_world_size"), release());
  m.def("join_end_step", &join_end_step, py::arg("reducer"), py::arg("announced"),
        py::arg("reduced"), release());
  m.def("join_shadow_step", &join_shadow_step, py::arg("proto"), py::arg("reducer"), release());
  m.def("join_sync_buffers", &join_sync_buffers, py::arg("proto"), py::arg("buffers"),
        py::arg("candidate"), release());
  m.def("join_sync_final",
        [](JoinProtocol& proto, const std::shared_ptr<Reducer>& reducer,
           const std::vector<at::Tensor>& tensors, bool is_last_joiner) {
          join_sync_final(proto, reducer.get(), tensors, is_last_joiner);
        },
        py::arg("proto"), py::arg("reducer"), py::arg("tensors"), py::arg("is_last_joiner"),
        release());
}

}  // namespace smp::python
