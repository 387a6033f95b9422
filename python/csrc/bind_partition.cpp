// Bindings of partition/: the Python tracer fills ModuleNodes, C++ decides.
#include <pybind11/stl.h>

#include "bindings.h"
#include "partition/partition.h"

namespace py = pybind11;

namespace smp::python {

void bind_partition(py::module_& m) {
  using namespace smp::partition;
  auto sub = m.def_submodule("partition", "auto-partitioner (C++)");
  static py::exception<PartitionError> partition_error(sub, "PartitionError", PyExc_ValueError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const PartitionError& e) {
      PyErr_SetString(partition_error.ptr(), e.what());
    }
  });
  py::class_<ModuleNode>(sub, "ModuleNode")
      .def(py::init<>())
      .def_readwrite("name", &ModuleNode::name)
      .def_readwrite("parent", &ModuleNode::parent)
      .def_readwrite("param_bytes", &ModuleNode::param_bytes)
      .def_readwrite("activation_bytes", &ModuleNode::activation_bytes)
      .def_readwrite("time_ms", &ModuleNode::time_ms)
      .def_readwrite("mem_bytes", &ModuleNode::mem_bytes)
      .def_readwrite("first_call", &ModuleNode::first_call)
      .def_readwrite("calls", &ModuleNode::calls)
      .def_readwrite("manual_partition", &ModuleNode::manual_partition)
      .def_readwrite("follow_parent", &ModuleNode::follow_parent);
  py::class_<Options>(sub, "Options")
      .def(py::init<>())
      .def_readwrite("partitions", &Options::partitions)
      .def_readwrite("memory_weight", &Options::memory_weight)
      .def_readwrite("param_memory_factor", &Options::param_memory_factor)
      .def_readwrite("activation_memory_factor", &Options::activation_memory_factor)
      .def_readwrite("auto_partition", &Options::auto_partition)
      .def_readwrite("default_partition", &Options::default_partition)
      .def_readwrite("balance_slack", &Options::balance_slack);
  py::class_<Plan>(sub, "Plan")
      .def_readonly("assignment", &Plan::assignment)
      .def_readonly("node_cost", &Plan::node_cost)
      .def_readonly("unit", &Plan::unit)
      .def_readonly("unit_order", &Plan::unit_order)
      .def_readonly("stage_cost", &Plan::stage_cost)
      .def_readonly("stage_param_bytes", &Plan::stage_param_bytes)
      .def_readonly("stage_memory_bytes", &Plan::stage_memory_bytes)
      .def_readonly("cut_depth", &Plan::cut_depth)
      .def_readonly("hash", &Plan::hash)
      .def("table", &Plan::table);
  sub.def("make_plan", &make_plan, py::arg("nodes"), py::arg("options"));
  sub.def("describe_units", &describe_units);
}

}  // namespace smp::python
