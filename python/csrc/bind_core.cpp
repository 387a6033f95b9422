// Bindings of smp_core: errors, Config, Topology, runtime install, object comm.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <pybind11/stl.h>

#include "bindings.h"
#include "smp_core/comm.h"
#include "smp_core/config.h"
#include "smp_core/errors.h"
#include "smp_core/runtime.h"
#include "smp_core/topology.h"

namespace py = pybind11;

namespace smp::python {
namespace {

using release = py::call_guard<py::gil_scoped_release>;

ProcessEnv make_env(int rank, int world, int local_rank, int local_size) {
  ProcessEnv e;
  e.rank = rank;
  e.world_size = world;
  e.local_rank = local_rank;
  e.local_size = local_size;
  return e;
}

ProcessGroupPtr group_of(const std::string& name) {
  const Groups& g = runtime().groups();
  if (name == "world") return g.world;
  if (name == "pp" || name == "mp") return g.pp;
  if (name == "dp") return g.dp;
  throw std::invalid_argument("smp: unknown group '" + name + "' (allowed: world, pp, mp, dp)");
}

}  // namespace

void bind_core(py::module_& m) {
  static py::exception<ConfigError> config_error(m, "ConfigError", PyExc_ValueError);
  static py::exception<CommError> comm_error(m, "CommError", PyExc_RuntimeError);
  static py::exception<TimeoutError> timeout_error(m, "SMPTimeoutError", comm_error.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ConfigError& e) {
      PyErr_SetString(config_error.ptr(), e.what());
    } catch (const TimeoutError& e) {
      PyErr_SetString(timeout_error.ptr(), e.what());
    } catch (const CommError& e) {
      PyErr_SetString(comm_error.ptr(), e.what());
    }
  });

  m.def("parse_config", [](const std::string& json, int rank) {
    return Config::from_json(json, rank).to_json();
  }, py::arg("json"), py::arg("rank") = -1,
        "Validates a config JSON object; returns the canonical resolved JSON.");
  m.def("config_keys", &config_keys);
  m.def("describe_config_disagreement", &describe_config_disagreement);
  m.def("config_from_environment", &config_from_environment);

  py::class_<Topology>(m, "Topology")
      .def(py::init<int, int, const std::string&>(), py::arg("world_size"),
           py::arg("pp_size"), py::arg("placement") = "cluster")
      .def_property_readonly("world_size", &Topology::world_size)
      .def_property_readonly("pp_size", &Topology::pp_size)
      .def_property_readonly("dp_size", &Topology::dp_size)
      .def("pp_rank", &Topology::pp_rank)
      .def("dp_rank", &Topology::dp_rank)
      .def("global_rank", &Topology::global_rank)
      .def("pp_group", &Topology::pp_group)
      .def("dp_group", &Topology::dp_group)
      .def("all_pp_groups", &Topology::all_pp_groups)
      .def("all_dp_groups", &Topology::all_dp_groups)
      .def("describe", &Topology::describe);

  m.def("agree_config", [](const StorePtr& store, int rank, int world, const std::string& raw) {
    return agree_config(store, make_env(rank, world, 0, 1), raw).to_json();
  }, release(), "Exchanges and checks every rank's config; returns the canonical JSON.");

  m.def("install", [](const std::string& config_json, int rank, int world, int local_rank,
                      int local_size, const StorePtr& store, const ProcessGroupPtr& world_pg,
                      const ProcessGroupPtr& pp_pg, const ProcessGroupPtr& dp_pg) {
    install(Config::from_json(config_json), make_env(rank, world, local_rank, local_size),
            store, Groups{world_pg, pp_pg, dp_pg});
  });
  m.def("is_initialized", &is_initialized);
  m.def("shutdown", &shutdown, release());

  // Object transport: Python pickles, C++ moves bytes. Groups by name: world, pp/mp, dp.
  m.def("send_bytes", [](int dst, const py::bytes& b) {
    std::string s = b;
    py::gil_scoped_release nogil;
    runtime().mailbox().send(dst, s);
  });
  m.def("recv_bytes", [](int src) {
    std::string s;
    {
      py::gil_scoped_release nogil;
      s = runtime().mailbox().recv(src);
    }
    return py::bytes(s);
  });
  m.def("allgather_bytes", [](const std::string& group, const py::bytes& b) {
    std::string s = b;
    std::vector<std::string> out;
    {
      py::gil_scoped_release nogil;
      out = allgather_bytes(group_of(group), s, runtime().config().timeout_s,
                            "smp.allgather on the " + group + " group");
    }
    py::list l;
    for (auto& x : out) l.append(py::bytes(x));
    return l;
  });
  m.def("barrier", [](const std::string& group) {
    barrier(group_of(group), runtime().config().timeout_s, "smp.barrier on the " + group + " group");
  }, release());
}

}  // namespace smp::python
