// Bindings of smp_core: errors, Config, Topology, runtime install, object comm.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <pybind11/stl.h>

#include <map>
#include <optional>

#include "bindings.h"
#include "smp_common/auth.h"
#include "smp_core/call_agreement.h"
#include "smp_core/comm.h"
#include "smp_core/config.h"
#include "smp_core/detail/shm_allreduce.h"
#include "smp_core/liveness.h"
#include "smp_core/net_interface.h"
#include "smp_core/device_sync.h"
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
  // The master's address, where the launcher gave one: groups made later in C++
  // (Runtime::make_group) bind toward it, as torch's own did.
  const char* master = std::getenv("MASTER_ADDR");
  if (master && *master) e.master_addr = master;
  e.master_port = env_int("MASTER_PORT", 0);
  return e;
}

// Names as smp.groups.group_name gives them: with tp = 1, "pp" and "dp" stand for the mp
// and rdp groups too (one name each in calls), and tp is never asked for.
ProcessGroupPtr group_of(const std::string& name) {
  const Groups& g = runtime().groups();
  if (name == "world") return g.world;
  if (name == "pp") return g.pp;
  if (name == "dp") return g.dp;
  if (name == "tp" && g.tp) return g.tp;
  if (name == "rdp" && g.rdp) return g.rdp;
  if (name == "mp" && g.mp) return g.mp;
  throw std::invalid_argument("smp: unknown group '" + name +
                              "' (allowed: world, pp, dp, and tp, rdp, mp when "
                              "tensor_parallel_degree > 1)");
}

// The group's kind as CallAgreement names it and its global ranks.
std::pair<std::string, std::vector<int>> members_of(const std::string& name) {
  const Runtime& rt = runtime();
  const Topology& t = rt.topology();
  if (name == "world") {
    std::vector<int> all(t.world_size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int>(i);
    return {"world", all};
  }
  if (name == "pp") return {"pp", t.pp_group(rt.rank())};
  if (name == "dp") return {"dp", t.dp_group(rt.rank())};
  if (name == "tp") return {"tp", t.tp_group(rt.rank())};
  if (name == "rdp") return {"rdp", t.rdp_group(rt.rank())};
  if (name == "mp") return {"mp", t.mp_group(rt.rank())};
  throw std::invalid_argument("smp: unknown group '" + name +
                              "' (allowed: world, pp, mp, dp, rdp, tp)");
}

// See Note [Call agreement]: every member is about to make `call` on the group.
void agree(const std::string& group, const std::string& call) {
  auto [kind, members] = members_of(group);
  call_agreement().agree(kind, members, call);
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
  m.def("build_info", [] {
    auto info = smp::device::build_info();
    py::dict d;
    d["torch_version"] = info.torch_version;
    d["cuda"] = info.cuda;
    d["nccl"] = info.nccl;
    d["cuda_paths"] = info.cuda_paths;
    return d;
  }, "What this build compiled: the torch it compiled against and its CUDA/NCCL paths.");
  m.def("choose_gloo_interface", [](const std::string& master_addr) {
    InterfaceChoice c;
    {
      py::gil_scoped_release nogil;
      c = choose_gloo_interface(master_addr);
    }
    return py::make_tuple(c.name, c.why);
  }, py::arg("master_addr"),
        "(interface, why): the interface Gloo should bind, '' for its default "
        "(Note [Gloo's interface] in smp_core/net_interface.cpp).");
  m.def("config_keys", &config_keys);
  m.def("describe_config_disagreement", &describe_config_disagreement);
  m.def("config_from_environment", &config_from_environment);

  // The one parser of RANK, WORLD_SIZE, ... (smp_core/runtime.h); launch_env.py reads
  // the world through it.
  py::class_<ProcessEnv>(m, "ProcessEnv")
      .def_readonly("rank", &ProcessEnv::rank)
      .def_readonly("world_size", &ProcessEnv::world_size)
      .def_readonly("local_rank", &ProcessEnv::local_rank)
      .def_readonly("local_size", &ProcessEnv::local_size)
      .def_readonly("master_addr", &ProcessEnv::master_addr)
      .def_readonly("master_port", &ProcessEnv::master_port)
      .def_readonly("torchelastic", &ProcessEnv::torchelastic)
      .def("__repr__", [](const ProcessEnv& e) {
        return str_cat("ProcessEnv(rank=", e.rank, ", world_size=", e.world_size,
                       ", local_rank=", e.local_rank, ", local_size=", e.local_size,
                       ", master_addr='", e.master_addr, "', master_port=", e.master_port,
                       ", torchelastic=", e.torchelastic ? "True" : "False", ")");
      });
  m.def("process_env", [](const std::optional<std::map<std::string, std::string>>& vars) {
    return vars ? ProcessEnv::from_variables(*vars) : ProcessEnv::from_environment();
  }, py::arg("vars") = py::none(),
        "Where this process sits, parsed from `vars` (a dict) or the process's environment. "
        "Raises smp.ConfigError naming the variable and its value.");
  m.def("set_malloc_mmap_threshold", &set_malloc_mmap_threshold, py::arg("bytes"),
        "Note [Fixed mmap threshold] (smp_core/runtime.h): glibc's mmap threshold, fixed "
        "at `bytes`; False where not glibc.");
  m.def("env_int", [](const std::string& name, int def,
                      const std::optional<std::map<std::string, std::string>>& vars) {
    return env_int(name, def, vars ? &*vars : nullptr);
  }, py::arg("name"), py::arg("default"), py::arg("vars") = py::none(),
        "The integer in environment variable `name` (of `vars` when given), or `default` "
        "when unset or empty. Raises smp.ConfigError naming the variable and its value.");

  py::class_<Topology>(m, "Topology")
      .def(py::init<int, int, const std::string&, int>(), py::arg("world_size"),
           py::arg("pp_size"), py::arg("placement") = "cluster", py::arg("tp_size") = 1)
      .def_property_readonly("world_size", &Topology::world_size)
      .def_property_readonly("pp_size", &Topology::pp_size)
      .def_property_readonly("tp_size", &Topology::tp_size)
      .def_property_readonly("rdp_size", &Topology::rdp_size)
      .def_property_readonly("dp_size", &Topology::dp_size)
      .def_property_readonly("mp_size", &Topology::mp_size)
      .def("pp_rank", &Topology::pp_rank)
      .def("tp_rank", &Topology::tp_rank)
      .def("rdp_rank", &Topology::rdp_rank)
      .def("dp_rank", &Topology::dp_rank)
      .def("mp_rank", &Topology::mp_rank)
      .def("global_rank", &Topology::global_rank)
      .def("global_rank_of", &Topology::global_rank_of)
      .def("pp_group", &Topology::pp_group)
      .def("tp_group", &Topology::tp_group)
      .def("rdp_group", &Topology::rdp_group)
      .def("dp_group", &Topology::dp_group)
      .def("mp_group", &Topology::mp_group)
      .def("all_pp_groups", &Topology::all_pp_groups)
      .def("all_tp_groups", &Topology::all_tp_groups)
      .def("all_rdp_groups", &Topology::all_rdp_groups)
      .def("all_dp_groups", &Topology::all_dp_groups)
      .def("all_mp_groups", &Topology::all_mp_groups)
      .def("describe", &Topology::describe)
      .def("check_tp_hosts", [](const Topology& t, const StorePtr& store, int rank,
                                double timeout_s) {
        // Note [A tp group on one host]: every rank's host, through the store.
        if (t.tp_size() <= 1 || t.world_size() <= 1) return;
        t.check_tp_hosts(store_exchange(store, "smp/tp_hosts", rank, t.world_size(),
                                        detail::host_identity(rank), timeout_s,
                                        "every rank's host (tensor_parallel_degree)"));
      }, py::arg("store"), py::arg("rank"), py::arg("timeout_s"), release(),
         "Note [A tp group on one host]: raises ConfigError on every rank when a tp group "
         "that the placement keeps on one host spans hosts.");

  m.def("agree_config", [](const StorePtr& store, int rank, int world, const std::string& raw) {
    return agree_config(store, make_env(rank, world, 0, 1), raw).to_json();
  }, release(), "Exchanges and checks every rank's config; returns the canonical JSON.");

  m.def("post_step_failure", &post_failure, py::arg("store"), py::arg("prefix"), py::arg("rank"),
        py::arg("step"), py::arg("why"), release(),
        "Note [Failed peer]: tells the waiting peers of this rank's dp group why it will not "
        "reach their reduction of `step`.");

  m.def("job_secret_from_environment", &auth::job_key_from_environment,
        "Whether this job's key came from SMP_JOB_SECRET (Note [Job secret]); false: rank 0 "
        "drew it and shared it through the store.");

  m.def("install", [](const std::string& config_json, int rank, int world, int local_rank,
                      int local_size, const StorePtr& store, const ProcessGroupPtr& world_pg,
                      const ProcessGroupPtr& pp_pg, const ProcessGroupPtr& dp_pg,
                      const ProcessGroupPtr& tp_pg, const ProcessGroupPtr& rdp_pg,
                      const ProcessGroupPtr& mp_pg) {
    install(Config::from_json(config_json), make_env(rank, world, local_rank, local_size),
            store, Groups{world_pg, pp_pg, dp_pg, tp_pg, rdp_pg, mp_pg});
  }, py::arg("config_json"), py::arg("rank"), py::arg("world"), py::arg("local_rank"),
        py::arg("local_size"), py::arg("store"), py::arg("world_pg"), py::arg("pp_pg"),
        py::arg("dp_pg"), py::arg("tp_pg") = py::none(), py::arg("rdp_pg") = py::none(),
        py::arg("mp_pg") = py::none(),
        "tp_pg, rdp_pg, mp_pg: only with tensor_parallel_degree > 1 (Note [Groups under "
        "tensor parallelism]).");
  m.def("is_initialized", &is_initialized);
  m.def("start_liveness", &start_liveness, release(),
        "Note [Rank heartbeat]: collective at init; a line for the log, or ''.");
  m.def("stop_liveness", &stop_liveness, release());
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
  // `call`: the user-facing API call these collectives serve ("model.state_dict()"),
  // agreed on by the group's members first (Note [Call agreement]).
  m.def("allgather_bytes", [](const std::string& group, const py::bytes& b,
                              const std::string& call) {
    std::string s = b;
    std::vector<std::string> out;
    {
      py::gil_scoped_release nogil;
      agree(group, call);
      out = allgather_bytes(group_of(group), s, runtime().config().timeout_s,
                            call + " (an allgather on the " + group + " group)");
    }
    py::list l;
    for (auto& x : out) l.append(py::bytes(x));
    return l;
  });
  m.def("barrier", [](const std::string& group, const std::string& call) {
    agree(group, call);
    barrier(group_of(group), runtime().config().timeout_s,
            call + " (a barrier on the " + group + " group)");
  }, release());
  m.def("agree_call", &agree, release(), py::arg("group"), py::arg("call"),
        "Before a torch collective on an smp group: every member is about to make `call`.");
  m.def("mark_exited", [](const std::string& how, double linger_s) {
    if (is_initialized()) call_agreement().mark_exited(how, linger_s);
    release_call_agreement();
  }, release(), py::arg("how"), py::arg("linger_s"),
        "At exit: tells ranks waiting in an smp call for this one that it is gone.");
}

}  // namespace smp::python
