// Bindings of the pipeline transport (smp_core/p2p), its schedule, plans and dispatch
// (smp_core/dispatch.h). The two sides of a module call are bound in bind_calls.cpp.
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <optional>

#include <pybind11/stl.h>

#include "bindings.h"
#include "smp_core/autocast_state.h"
#include "smp_core/detail/task_pool.h"
#include "smp_core/dispatch.h"
#include "smp_core/errors.h"
#include "smp_core/loss_scale.h"
#include "smp_core/p2p.h"
#include "smp_core/plan.h"
#include "smp_core/reducer.h"
#include "smp_core/remote_call.h"
#include "smp_core/serve.h"
#include "smp_core/tied_grads.h"

namespace py = pybind11;

namespace smp::python {

SharedFn share(py::function f) {
  return SharedFn(new py::function(std::move(f)), [](py::function* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

namespace {

// Calls `f` holding the GIL and converts its result to R (void: drops it) before letting
// go of the GIL. A Python exception becomes a C++ one (it may be rethrown on another
// thread, where a pending Python error would be meaningless).
template <typename R, typename... Args>
R call_python(const SharedFn& f, Args&&... args) {
  py::gil_scoped_acquire gil;
  try {
    py::object out = (*f)(std::forward<Args>(args)...);
    if constexpr (!std::is_void_v<R>) {
      try {
        return out.cast<R>();
      } catch (const py::builtin_exception&) {  // cast_error, reference_cast_error (None)
        throw std::runtime_error("smp: " + std::string(py::str(py::repr(*f))) + " returned " +
                                 std::string(py::str(py::repr(out))) + ", not a " +
                                 py::type_id<R>());
      }
    }
  } catch (py::error_already_set& e) {
    throw std::runtime_error(e.what());
  }
}

}  // namespace

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

void bind_pipeline(py::module_& m) {
  using release = py::call_guard<py::gil_scoped_release>;
  py::enum_<MsgKind>(m, "MsgKind", py::arithmetic())
      .value("REQUEST", kRequest)
      .value("RESPONSE", kResponse)
      .value("BACKWARD_REQUEST", kBackwardRequest)
      .value("BACKWARD_RESPONSE", kBackwardResponse)
      .value("ERROR", kError)
      .value("MICROBATCH_DONE", kMicrobatchDone)
      .value("WEIGHTS_DONE", kWeightsDone)
      .value("STEP_END", kStepEnd)
      .value("ABORT", kAbort)
      .export_values();
  m.attr("ANY") = kAny;
  py::enum_<RecvOrder>(m, "RecvOrder")
      .value("ARRIVAL", RecvOrder::kArrival)
      .value("BACKWARD_FIRST", RecvOrder::kBackwardFirst)
      .value("FORWARD_FIRST", RecvOrder::kForwardFirst);
  // The plans as data (smp_core/plan.h): compiled, validated, printed and simulated
  // without processes; bench/pipeline.py reports zero_bubble's bubble against 1f1b's.
  py::class_<Plan>(m, "Plan")
      .def(py::init([](const std::string& kind, int64_t microbatches, int64_t stages,
                       int64_t active, const std::vector<int64_t>& path,
                       std::tuple<int64_t, int64_t, int64_t> costs, bool gradient_order,
                       bool fused_last, int64_t unsplit_rank, bool last_hop_accumulates,
                       bool search) {
             PlanOptions o;
             o.search = search;
             o.gradient_order = gradient_order;
             o.fused_last = fused_last;
             o.last_hop_accumulates = last_hop_accumulates;
             o.unsplit_rank = unsplit_rank;
             o.kind = plan_kind_from_name(kind);
             o.microbatches = microbatches;
             o.stages = stages;
             o.active_microbatches = active;
             o.path = path;
             o.costs = {std::get<0>(costs), std::get<1>(costs), std::get<2>(costs)};
             return Plan::compile(o);
           }),
           py::arg("kind"), py::arg("microbatches"), py::arg("stages"),
           py::arg("active_microbatches") = 3, py::arg("path") = std::vector<int64_t>{},
           py::arg("costs") = std::make_tuple(int64_t{1}, int64_t{1}, int64_t{1}),
           py::arg("gradient_order") = false, py::arg("fused_last") = false,
           py::arg("unsplit_rank") = -1, py::arg("last_hop_accumulates") = true,
           py::arg("search") = true,
           "gradient_order, fused_last, unsplit_rank, last_hop_accumulates: the runtime's "
           "constraints (smp_core/plan.h PlanOptions); the plan the runtime executes has "
           "gradient_order and fused_last on (not under 'simple'), for zero_bubble "
           "unsplit_rank 0, and last_hop_accumulates as the driver saw it (Note [Last "
           "hop's gradients]). search: Note [Plan search] (false: the kind's rule alone).")
      .def_static("executed",
                  [](const std::string& kind, int64_t microbatches, int64_t stages, int64_t active,
                     const std::vector<int64_t>& path, bool last_hop_accumulates) {
                    return Plan::compile(executed_plan_options(plan_kind_from_name(kind),
                                                               microbatches, stages, active, path,
                                                               last_hop_accumulates));
                  },
                  py::arg("kind"), py::arg("microbatches"), py::arg("stages"),
                  py::arg("active_microbatches"), py::arg("path"),
                  py::arg("last_hop_accumulates"),
                  "The plan the runtime executes for the driver's calls `path` (Note "
                  "[Executed plan]): its constraints and costs, smp_core/plan.h "
                  "executed_plan_options.")
      .def("window", &Plan::window)
      .def("validate", &Plan::validate)
      .def("compute", [](const Plan& p) {
             std::vector<std::vector<std::string>> out;
             for (const auto& list : p.compute()) {
               out.emplace_back();
               for (const auto& a : list) out.back().push_back(a.str(true));
             }
             return out;
           }, "Per pp rank, the compute actions in order, as 'F3.h0' (op, microbatch, hop).")
      .def("format", [](const Plan& p) { return p.format(); })
      .def("timeline", [](const Plan& p) { return p.timeline(); })
      .def("simulate", [](const Plan& p) {
             auto t = p.simulate();
             py::dict d;
             d["makespan"] = t.makespan;
             d["busy"] = t.busy;
             d["bubble_fraction"] = t.bubble_fraction;
             return d;
           });
  py::enum_<PayloadTransport>(m, "PayloadTransport")
      .value("TCP", PayloadTransport::kTcp)
      .value("C10D", PayloadTransport::kC10d)
      .value("AUTO", PayloadTransport::kAuto);
  py::class_<Message>(m, "Message")
      .def(py::init([](int64_t mb, int64_t call_id, int32_t kind, const py::bytes& meta,
                       std::vector<at::Tensor> tensors) {
             Message msg;
             msg.mb = mb;
             msg.call_id = call_id;
             msg.kind = kind;
             msg.meta = meta;
             msg.tensors = std::move(tensors);
             return msg;
           }),
           py::arg("mb"), py::arg("call_id"), py::arg("kind"), py::arg("meta") = py::bytes(),
           py::arg("tensors") = std::vector<at::Tensor>{})
      .def_readonly("src", &Message::src)
      .def_readonly("epoch", &Message::epoch)
      .def_readonly("mb", &Message::mb)
      .def_readonly("call_id", &Message::call_id)
      .def_readonly("kind", &Message::kind)
      .def_property_readonly("meta", [](const Message& msg) { return py::bytes(msg.meta); })
      .def_readonly("tensors", &Message::tensors)
      .def_property_readonly("rng", [](const Message& msg) { return py::bytes(msg.rng); });
  py::class_<P2PEngine::Stats>(m, "P2PStats")
      .def_readonly("messages_sent", &P2PEngine::Stats::messages_sent)
      .def_readonly("messages_received", &P2PEngine::Stats::messages_received)
      .def_readonly("bytes_sent", &P2PEngine::Stats::bytes_sent)
      .def_readonly("bytes_received", &P2PEngine::Stats::bytes_received)
      .def_readonly("wait_s", &P2PEngine::Stats::wait_s)
      .def_readonly("token_held_s", &P2PEngine::Stats::token_held_s);
  py::class_<P2PEngine, std::shared_ptr<P2PEngine>>(m, "P2PEngine")
      .def(py::init<c10::intrusive_ptr<c10d::Store>, const std::string&, int, int, double,
                    const std::string&>(),
           py::arg("store"), py::arg("prefix"), py::arg("rank"), py::arg("size"),
           py::arg("timeout_s"), py::arg("master_addr") = "127.0.0.1", release())
      .def_property_readonly("rank", &P2PEngine::rank)
      .def_property_readonly("size", &P2PEngine::size)
      .def("send", &P2PEngine::send, release())
      .def("recv", &P2PEngine::recv, py::arg("mb"), py::arg("call_id"), py::arg("kind_mask"),
           py::arg("what"), py::arg("yield_token") = false, py::arg("priority") = 0,
           py::arg("order") = RecvOrder::kArrival, py::arg("for_holder") = false, release())
      .def("acquire_token", &P2PEngine::acquire_token, release())
      .def("release_token", &P2PEngine::release_token, release())
      .def("begin_step", &P2PEngine::begin_step, py::arg("epoch"))
      .def("set_payload_group", &P2PEngine::set_payload_group, py::arg("group"),
           py::arg("transport"), py::arg("device") = "cpu")
      .def("stats", &P2PEngine::stats);
  // Note [Task threads] (smp_core/detail/task_pool.h): each thread holds one Python
  // thread state for its life, taken at its start and given back at its end unless
  // the interpreter is finalizing then (a thread state cannot be freed then; it is
  // left to the process's exit).
  py::class_<detail::TaskPool, std::shared_ptr<detail::TaskPool>>(m, "TaskPool")
      .def(py::init([](const std::string& name) {
             static thread_local PyThreadState* own = nullptr;
             auto start = [] {
               PyGILState_Ensure();
               own = PyEval_SaveThread();
             };
             auto exit = [] {
               if (!own || !Py_IsInitialized() || python_finalizing()) return;
               PyEval_RestoreThread(own);
               own = nullptr;
               PyGILState_Release(PyGILState_UNLOCKED);
             };
             // Dropped with the GIL held (the last reference is Python's): its threads
             // need the GIL to end, so it is let go of while they stop.
             return std::shared_ptr<detail::TaskPool>(
                 new detail::TaskPool(name, start, exit), [](detail::TaskPool* pool) {
                   if (Py_IsInitialized() && PyGILState_Check()) {
                     py::gil_scoped_release nogil;
                     delete pool;
                   } else {
                     delete pool;
                   }
                 });
           }), py::arg("name"))
      .def("stop", &detail::TaskPool::stop, release())
      .def_property_readonly("threads", &detail::TaskPool::threads)
      .def_property_readonly("idle", &detail::TaskPool::idle);
  // Serving and dispatch (smp_core/dispatch.h). `handler(msg) -> Message` runs a request;
  // `spawn(fn)` runs the no-argument callable fn on a (persistent) Python thread.
  py::class_<Dispatcher::Stats>(m, "DispatchStats")
      .def_readonly("requests", &Dispatcher::Stats::requests)
      .def_readonly("handler_s", &Dispatcher::Stats::handler_s)
      .def_readonly("send_s", &Dispatcher::Stats::send_s)
      .def_readonly("ordered_waits", &Dispatcher::Stats::ordered_waits)
      .def_readonly("forward_order_waits", &Dispatcher::Stats::forward_order_waits)
      .def_readonly("unplanned_steps", &Dispatcher::Stats::unplanned_steps)
      .def_readonly("crossings", &Dispatcher::Stats::crossings)
      .def_readonly("microbatches", &Dispatcher::Stats::microbatches)
      .def_readonly("planned_steps", &Dispatcher::Stats::planned_steps)
      .def_readonly("plan_fallbacks", &Dispatcher::Stats::plan_fallbacks)
      .def_readonly("new_plans", &Dispatcher::Stats::new_plans)
      .def_readonly("native_backwards", &Dispatcher::Stats::native_backwards)
      .def_readonly("split_backwards", &Dispatcher::Stats::split_backwards)
      .def_readonly("weight_actions", &Dispatcher::Stats::weight_actions)
      .def_readonly("backward_s", &Dispatcher::Stats::backward_s);
  py::class_<Dispatcher, std::shared_ptr<Dispatcher>>(m, "Dispatcher")
      .def(py::init([](std::shared_ptr<P2PEngine> p2p, const std::string& kind,
                       int64_t microbatches, int64_t stages, int64_t active_microbatches,
                       std::shared_ptr<Server> server, py::object spawn, py::object encode_error,
                       py::object raise_error) {
             // The step's order (smp_core/plan.h; Note [Order without a list]).
             const PlanOptions order = step_options(plan_kind_from_name(kind), microbatches,
                                                    stages, active_microbatches);
             // `spawn`: a TaskPool (C++ threads, Note [Task threads]) or a Python
             // callable `spawn(fn)` that runs fn on a thread of its own.
             Dispatcher::Spawn run_on;
             const bool native = py::isinstance<detail::TaskPool>(spawn);
             if (native) {
               auto pool = spawn.cast<std::shared_ptr<detail::TaskPool>>();
               run_on = [pool](std::function<void()> body) { pool->spawn(std::move(body)); };
             } else {
               auto sp = share(spawn.cast<py::function>());
               run_on = [sp](std::function<void()> body) {
                 py::gil_scoped_acquire gil;
                 call_python<void>(sp, py::cpp_function([body = std::move(body)] {
                   py::gil_scoped_release nogil;
                   body();
                 }));
               };
             }
             Dispatcher::ErrorEncoder enc;
             if (!encode_error.is_none()) {
               auto e = share(encode_error.cast<py::function>());
               enc = [e](const std::string& what) {
                 return call_python<std::string>(e, py::str(what));
               };
             }
             // Note [Known forward requests] (smp_core/serve.h): `server` serves every
             // request and keeps its graph in the dispatcher.
             auto d = std::make_shared<Dispatcher>(
                 std::move(p2p), order,
                 [server](const Message& msg) { return server->serve(msg); },
                 std::move(run_on), std::move(enc));
             d->set_spawn_crosses(!native);
             server->attach(d);
             if (!raise_error.is_none()) {
               // raise_error(meta) raises the answer's exception. It must reach the
               // caller of backward() as that Python exception, not a RuntimeError:
               // it travels through autograd's engine as torch's python_error.
               auto r = share(raise_error.cast<py::function>());
               d->set_error_raiser([r](const Message& answer) {
                 py::gil_scoped_acquire gil;
                 try {
                   (*r)(py::bytes(answer.meta));
                 } catch (py::error_already_set& e) {
                   e.restore();
                   python_error err;
                   err.persist();
                   throw err;
                 }
               });
             }
             return d;
           }),
           py::arg("p2p"), py::arg("kind"), py::arg("microbatches"), py::arg("stages"),
           py::arg("active_microbatches"), py::arg("server"), py::arg("spawn"),
           py::arg("encode_error") = py::none(), py::arg("raise_error") = py::none())
      .def("begin_step", &Dispatcher::begin_step, py::arg("microbatches"),
           py::arg("deterministic") = false, py::arg("rng_cuda") = false,
           py::arg("planned") = true, release())
      .def("order_gradients", &Dispatcher::order_gradients, py::arg("params"))
      .def("drive", [](Dispatcher& d, py::function run) {
             auto fn = share(std::move(run));
             py::gil_scoped_release nogil;
             d.drive([fn](int64_t mb) { call_python<void>(fn, mb); });
           }, py::arg("run"))
      // Note [Step end]: `run(mb)` returns its share of the step's end, a STEP_END
      // Message (its outputs) or an ABORT (its error); returns whether the step ended.
      .def("drive_step", [](Dispatcher& d, py::function run) {
             auto fn = share(std::move(run));
             py::gil_scoped_release nogil;
             return d.drive_step([fn](int64_t mb) { return call_python<Message>(fn, mb); });
           }, py::arg("run"))
      .def_static("step_end_parts", &Dispatcher::step_end_parts, py::arg("end"))
      .def("tell_pp_ranks", &Dispatcher::tell_pp_ranks, py::arg("msg"), py::arg("to_self") = false,
           release())
      .def("serve_step", &Dispatcher::serve_step, release())
      .def("call", &Dispatcher::call, py::arg("dst"), py::arg("request"), py::arg("kind"),
           py::arg("backward"), py::arg("what"), py::arg("for_holder") = false, release())
      .def("wait", &Dispatcher::wait, py::arg("mb"), py::arg("call_id"), py::arg("kind"),
           py::arg("backward"), py::arg("what"), py::arg("for_holder") = false, release())
      .def("forward_finished", &Dispatcher::forward_finished, py::arg("mb"), release())
      .def("wait_all_forwards", &Dispatcher::wait_all_forwards, py::arg("mb"), release())
      .def("stats", &Dispatcher::stats)
      // The driver's window (smp_core/plan.h driver_window) and whether backward waits
      // for every forward ("simple").
      .def("window", [](const Dispatcher& d) {
             const PlanOptions& o = d.options();
             return driver_window(o.kind, o.microbatches, o.stages, o.active_microbatches);
           })
      .def("forwards_before_backwards",
           [](const Dispatcher& d) { return forwards_before_backwards(d.options().kind); })
      // Note [Served backward]: `encode(exc, mb, weight) -> bytes` is the kError meta of a
      // served backward of microbatch `mb` that raised `exc` (a C++ error arrives as a
      // RuntimeError); `weight`: in its W (zero_bubble).
      .def("set_failure_encoder", [](Dispatcher& d, py::function encode) {
             auto e = share(std::move(encode));
             d.set_failure_encoder([e](std::exception_ptr error, int64_t mb,
                                       bool weight) -> std::string {
               py::gil_scoped_acquire gil;
               py::object exc = python_exception(error);
               return call_python<std::string>(e, exc, mb, weight);
             });
           }, py::arg("encode"))
      .def("keep_for_backward", &Dispatcher::keep_for_backward, py::arg("src"), py::arg("mb"),
           py::arg("call_id"), py::arg("inputs"), py::arg("outputs"), release())
      .def("record_spans", &Dispatcher::record_spans, py::arg("on"))
      .def("take_spans", &Dispatcher::take_spans)
      // Note [Arming at the first backward]: the dp reducer of a synchronized step arms
      // itself (prepare_for_pipeline_backward with `hold`) at this rank's first gradient
      // accumulation, in C++.
      .def("arm_reducer", [](Dispatcher& d, std::shared_ptr<Reducer> reducer,
                             std::vector<int64_t> hold) {
             d.arm_at_first_backward([reducer, hold = std::move(hold)] {
               reducer->prepare_for_pipeline_backward(1.0, hold);
             });
           }, py::arg("reducer"), py::arg("hold"), release())
      // Note [Step's finish]: at the step's end, in C++: the tied gradients' sum, then
      // (a reducing step) arming a rank with no backward work and the reducer's finalize.
      // Note [One overflow decision] (smp_core/loss_scale.cpp): with `overflow`, the
      // job-wide check of the final gradients comes last.
      .def("finish_step_with", [](Dispatcher& d, std::shared_ptr<TiedGradients> tied,
                                  std::shared_ptr<Reducer> reducer,
                                  std::shared_ptr<OverflowCheck> overflow) {
             Dispatcher* dp = &d;  // the finish lives in `d`: no cycle through a shared_ptr
             d.finish_at_step_end([dp, tied, reducer, overflow](bool backward) {
               if (!backward) {
                 if (tied) tied->restore();
                 return;
               }
               if (tied) tied->sum();
               if (reducer) {
                 dp->arm_now();  // a rank that had no backward work of its own
                 reducer->finalize();
               }
               if (overflow) overflow->run();
             });
           }, py::arg("tied"), py::arg("reducer"), py::arg("overflow") = nullptr, release())
      .def("finish_began", &Dispatcher::finish_began)
      .def("arm_now", &Dispatcher::arm_now, release())
      .def("disarm", &Dispatcher::disarm, release())
      // Note [Executed plan] (smp_core/dispatch.cpp).
      .def("planned_actions", &Dispatcher::planned_actions)
      .def("executed_actions", &Dispatcher::executed_actions)
      .def("plan_departure", &Dispatcher::plan_departure)  // Note [Leaving the plan]
      // `cell`: (pp rank, microbatch, backward) or, for a W, (..., True, True).
      .def("plan_text", [](const Dispatcher& d, std::optional<py::tuple> cell) {
             if (!cell || cell->size() < 3) return d.plan_text();
             FailedCell c{(*cell)[0].cast<int64_t>(), (*cell)[1].cast<int64_t>(),
                          (*cell)[2].cast<bool>() ? Phase::kBackward : Phase::kForward,
                          cell->size() > 3 && (*cell)[3].cast<bool>()};
             return d.plan_text(&c);
           }, py::arg("cell") = py::none());
  // Note [Remote call node] (smp_core/remote_call.h).
  m.def("parse_gradient_flags",
        [](const py::bytes& meta, size_t n, const std::string& what) {
          return parse_gradient_flags(std::string(meta), n, what);
        },
        py::arg("meta"), py::arg("n"), py::arg("what") = "a gradient message");

  // Note [Tied gradient sum] (smp_core/tied_grads.cpp).
  py::class_<TiedGradients, std::shared_ptr<TiedGradients>>(m, "TiedGradients")
      .def(py::init([](const std::vector<std::tuple<std::string, at::Tensor, ProcessGroupPtr>>& held,
                       double timeout_s) {
             std::vector<TiedGradients::Entry> entries;
             for (const auto& [name, param, group] : held) entries.push_back({name, param, group});
             return std::make_shared<TiedGradients>(std::move(entries), timeout_s);
           }),
           py::arg("held"), py::arg("timeout_s"))
      .def("begin_step", &TiedGradients::begin_step)
      .def("sum", &TiedGradients::sum, release())
      .def("restore", &TiedGradients::restore)
      .def("__len__", &TiedGradients::size);
}

}  // namespace smp::python
