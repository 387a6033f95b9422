// Bindings of the reducer: smp._C.Reducer, GradBucket, BuiltinCommHookType, BuiltinHook
// and the built-in hook objects, and broadcast_coalesced. See docs/reducer.md ("Python API"). The Join
// protocol is bound in bind_join.cpp.
//
// GIL: the reducer runs comm hooks on its own thread; a Python hook takes the GIL
// there. So every binding that may wait on communication (the constructor, finalize,
// run_shadow_step, broadcast_coalesced, destruction) releases the GIL.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>

#include "bindings.h"
#include "hooks/builtin.h"
#include "hooks/powersgd.h"
#include "smp_core/comm_queue.h"
#include "smp_core/errors.h"
#include "smp_core/grad_bucket.h"
#include "smp_core/reducer.h"
#include "smp_core/runtime.h"

namespace py = pybind11;

namespace smp::python {
namespace {

using release = py::call_guard<py::gil_scoped_release>;

// Note [Python hooks at exit]: a Python hook's future usually comes from
// `fut.then(fn)`. torch runs `fn` on a Gloo worker thread when the collective
// completes, completes our future from inside it, and only then destroys its closure,
// which drops `fn` and so must take the GIL. If the script ends in between (its last
// step returned as soon as our future completed), that thread asks for the GIL while
// the interpreter finalizes; CPython ends such a thread with pthread_exit, whose forced
// unwind meets a noexcept frame: "terminate called without an active exception",
// SIGABRT after a successful job (caught with a core: the thread was
// c10d::ProcessGroupGloo::runLoop -> finishWorkGloo -> Future::markCompleted ->
// ~PythonFunctionGuard -> gil_scoped_acquire). The closure also holds our future, so
// it is gone when nobody but us holds the future: quiesce_python_hooks(), called at
// exit (smp's atexit handler and smp.shutdown) with the GIL released, waits for that,
// and the worker thread finishes with the interpreter still alive.
class PythonCommHook;
std::mutex python_hooks_mu;
std::vector<std::weak_ptr<PythonCommHook>> python_hooks;  // live hooks, for the exit

// A Python hook `hook(state, bucket) -> torch.futures.Future[Tensor]`.
class PythonCommHook : public CommHook {
 public:
  PythonCommHook(py::object state, py::object hook)
      : state_(std::move(state)), hook_(std::move(hook)) {
    py::object qual = py::getattr(hook_, "__qualname__", py::none());
    name_ = "python hook " + py::str(qual.is_none() ? py::repr(hook_) : qual).cast<std::string>();
  }
  ~PythonCommHook() override {
    py::gil_scoped_acquire gil;
    state_ = py::object();
    hook_ = py::object();
  }

  FuturePtr run(GradBucket& bucket) override {
    std::shared_ptr<GradBucket> b = bucket.weak_from_this().lock();
    if (!b) b = std::make_shared<GradBucket>(bucket);
    py::gil_scoped_acquire gil;
    try {
      py::object ret = hook_(state_, b);
      try {
        FuturePtr fut = ret.cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>()->fut;
        remember(fut);
        return fut;
      } catch (const py::cast_error&) {
        throw std::runtime_error(str_cat(
            name_, " returned ", py::str(py::type::of(ret)).cast<std::string>(),
            "; a comm hook must return a torch.futures.Future of the reduced tensor"));
      }
    } catch (py::error_already_set& e) {
      throw std::runtime_error(e.what());  // the message, made while holding the GIL
    }
  }

  at::Tensor result(GradBucket& bucket, const c10::IValue& value) override {
    if (!value.isPyObject()) return CommHook::result(bucket, value);
    py::gil_scoped_acquire gil;
    auto obj = py::reinterpret_borrow<py::object>(value.toPyObject());
    if ((py::isinstance<py::list>(obj) || py::isinstance<py::tuple>(obj)) && py::len(obj) > 0)
      obj = obj.cast<py::sequence>()[0];
    if (!THPVariable_Check(obj.ptr()))
      throw std::runtime_error(str_cat(
          "the future of ", name_, " holds ", py::str(py::type::of(obj)).cast<std::string>(),
          ", expected a Tensor (or a list whose first item is one)"));
    return THPVariable_Unpack(obj.ptr());
  }

  std::string name() const override { return name_; }

  // Note [Python hooks at exit]: waits until every future this hook returned is held
  // by this hook alone, or until `deadline` (a future the user's code still holds).
  // Returns how many were still held elsewhere then, and forgets them. Call without
  // the GIL.
  size_t quiesce(std::chrono::steady_clock::time_point deadline) {
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        prune_locked();
        if (recent_.empty() || std::chrono::steady_clock::now() >= deadline) {
          const size_t left = recent_.size();
          recent_.clear();
          return left;
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

 private:
  void remember(const FuturePtr& fut) {
    std::lock_guard<std::mutex> lock(mu_);
    prune_locked();
    recent_.push_back(fut);
  }
  // Drops the futures nobody else holds (their producers' closures are gone).
  void prune_locked() {
    recent_.erase(std::remove_if(recent_.begin(), recent_.end(),
                                 [](const FuturePtr& f) {
                                   return f->completed() && f.use_count() == 1;
                                 }),
                  recent_.end());
  }

  py::object state_, hook_;
  std::string name_;
  std::mutex mu_;
  std::vector<FuturePtr> recent_;
};

// Note [Python hooks at exit]: returns once no Python hook's future is held by anyone
// but the hook (the thread that completed it has dropped its callback), or after
// `timeout_s`; returns how many futures were still held elsewhere then.
size_t quiesce_python_hooks(double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  std::vector<std::shared_ptr<PythonCommHook>> live;
  {
    std::lock_guard<std::mutex> lock(python_hooks_mu);
    for (const auto& w : python_hooks)
      if (auto h = w.lock()) live.push_back(std::move(h));
  }
  size_t left = 0;
  for (const auto& h : live) left += h->quiesce(deadline);
  // `live` may hold the last reference to a hook: drop it with the GIL (its
  // destructor takes it; the caller released it).
  py::gil_scoped_acquire gil;
  live.clear();
  return left;
}

// A built-in hook as a Python object: callable like any hook, recognised by
// Reducer.register_comm_hook, which then runs the C++ hook instead.
struct BuiltinHook {
  hooks::BuiltinCommHookType type;
  py::object inner;  // wrappers: the wrapped hook (BuiltinHook or callable)
  // What Python sees as `.name` and what pickles store ("powerSGD").
  const std::string& name() const { return hooks::builtin_hook_name(type); }
};

CommHookPtr to_comm_hook(const py::object& state, const py::object& hook);

// The C++ state behind `state`: an smp PowerSGDState (its `_native`) or the native one.
hooks::PowerSGDStatePtr powersgd_state(const py::object& state, const BuiltinHook& bh) {
  py::object native = py::hasattr(state, "_native") ? state.attr("_native") : state;
  try {
    return native.cast<hooks::PowerSGDStatePtr>();
  } catch (const py::cast_error&) {
    throw ConfigError(str_cat("smp: ", bh.name(), "_hook takes an "
                              "smp.ddp_comm_hooks.powerSGD_hook.PowerSGDState as its state, not ",
                              py::str(py::type::of(state)).cast<std::string>()));
  }
}

CommHookPtr builtin_to_comm_hook(const py::object& state, const BuiltinHook& bh,
                                 int64_t channel_size = 512) {
  if (hooks::is_powersgd(bh.type)) {
    auto st = powersgd_state(state, bh);
    return bh.type == hooks::BuiltinCommHookType::kPowerSGD ? hooks::powersgd_hook(st)
                                                             : hooks::batched_powersgd_hook(st);
  }
  CommHookPtr inner = bh.inner.is_none() ? nullptr : to_comm_hook(state, bh.inner);
  ProcessGroupPtr pg;
  if (!hooks::is_wrapper(bh.type) && !state.is_none()) {
    try {
      pg = state.cast<ProcessGroupPtr>();
    } catch (const py::cast_error&) {
      throw ConfigError(str_cat("smp: built-in hook ", bh.name(), "_hook takes a ProcessGroup or "
                                "None as its state, not ",
                                py::str(py::type::of(state)).cast<std::string>()));
    }
  }
  return hooks::make_builtin_hook(bh.type, pg, inner, default_timeout(), channel_size);
}

// Note [Built-in hooks under torch DDP]
// torch's reducer calls a Python hook with its own c10d::GradBucket, on the autograd
// thread, bucket after bucket in index order. smp's built-ins take smp's GradBucket,
// so this builds one from torch's (buffer, index, is_last, parameters; the offsets are
// read off its gradient views) and queues the hook's chain on the group's ordered
// queue (group_queue in smp_core/comm_queue.h): the autograd thread goes on with
// backward, and every collective of every bucket is issued from that one thread in
// bucket order, none from a completion callback. That is what keeps PowerSGD with
// many buckets alive on Gloo where torch's own hook aborts (FACTS.md). result()
// (decompression) runs in the completion callback: local arithmetic only.
std::shared_ptr<torch::jit::PythonFutureWrapper> run_on_torch_bucket(
    const BuiltinHook& self, const py::object& state, const py::object& bucket,
    const ProcessGroupPtr& default_pg, const ProcessGroupPtr& queue_pg, int64_t channel_size) {
  at::Tensor buffer = bucket.attr("buffer")().cast<at::Tensor>();
  const auto index = bucket.attr("index")().cast<size_t>();
  const bool last = bucket.attr("is_last")().cast<bool>();
  auto params = bucket.attr("parameters")().cast<std::vector<at::Tensor>>();
  auto grads = bucket.attr("gradients")().cast<std::vector<at::Tensor>>();
  SMP_CHECK(grads.size() == params.size(), "torch GradBucket ", index, ": ", params.size(),
            " parameters but ", grads.size(), " gradients");
  std::vector<int64_t> offsets;
  for (const auto& g : grads) offsets.push_back(g.storage_offset() - buffer.storage_offset());
  // torch's bucket knows only whether it is last; a count that says the same suffices.
  auto b = std::make_shared<GradBucket>(index, last ? index + 1 : index + 2, buffer,
                                        std::move(params), std::move(offsets), default_pg);
  CommHookPtr hook = builtin_to_comm_hook(state, self, channel_size);
  auto out = c10::make_intrusive<c10::ivalue::Future>(c10::PyObjectType::get());
  const double timeout = default_timeout();
  const std::string what = str_cat("bucket ", index, " of comm hook '", hook->name(),
                                   "' under torch DistributedDataParallel");
  // A task the queue skips (an earlier one failed) is dropped unrun: its future must
  // still complete, or torch's reducer would wait on it forever.
  struct FailIfUnrun {
    FuturePtr out;
    std::string what;
    bool ran = false;
    ~FailIfUnrun() {
      if (!ran)
        out->setErrorIfNeeded(std::make_exception_ptr(CommError(str_cat(
            "smp: ", what, " was not run: an earlier comm hook task on its group failed"))));
    }
  };
  auto guard = std::make_shared<FailIfUnrun>();
  guard->out = out;
  guard->what = what;
  group_queue(queue_pg).submit(what, [hook, b, out, timeout, what, guard] {
    guard->ran = true;
    FuturePtr f;
    try {
      f = hook->run(*b);
    } catch (...) {
      out->setError(std::current_exception());
      throw;  // the group's order is lost on this rank: later buckets fail at once
    }
    f->addCallback([hook, b, out](c10::ivalue::Future& done) {
      if (done.hasError()) {
        out->setError(done.exception_ptr());
        return;
      }
      c10::IValue value;
      try {
        at::Tensor t = hook->result(*b, done.value());
        // torch 1.13's reducer reads a Python hook's result only as a Python object.
        py::gil_scoped_acquire gil;
        value = torch::jit::toIValue(py::cast(t), c10::PyObjectType::get());
      } catch (...) {
        out->setError(std::current_exception());
        return;
      }
      out->markCompleted(std::move(value));
    });
    if (!hook->issues_all_in_run()) wait_future(f, timeout, what);
  });
  return std::make_shared<torch::jit::PythonFutureWrapper>(out);
}

CommHookPtr to_comm_hook(const py::object& state, const py::object& hook) {
  if (py::isinstance<BuiltinHook>(hook)) return builtin_to_comm_hook(state, hook.cast<BuiltinHook&>());
  // smp.ddp_comm_hooks' public hooks: Python functions carrying the C++ hook.
  py::object native = py::getattr(hook, "_smp_builtin", py::none());
  if (py::isinstance<BuiltinHook>(native)) return builtin_to_comm_hook(state, native.cast<BuiltinHook&>());
  if (!PyCallable_Check(hook.ptr()))
    throw ConfigError(str_cat("smp: register_comm_hook: hook=",
                              py::repr(hook).cast<std::string>(), " is not callable"));
  auto made = std::make_shared<PythonCommHook>(state, hook);
  std::lock_guard<std::mutex> lock(python_hooks_mu);
  python_hooks.erase(std::remove_if(python_hooks.begin(), python_hooks.end(),
                                    [](const auto& w) { return w.expired(); }),
                     python_hooks.end());
  python_hooks.push_back(made);
  return made;
}

BuiltinHook make_builtin(hooks::BuiltinCommHookType type, py::object inner);

// By name: an unknown one throws the ConfigError listing the names.
BuiltinHook make_builtin(const std::string& name, py::object inner) {
  return make_builtin(hooks::builtin_hook_type(name), std::move(inner));
}

BuiltinHook make_builtin(hooks::BuiltinCommHookType type, py::object inner) {
  const std::string& name = hooks::builtin_hook_name(type);
  if (hooks::is_wrapper(type) == inner.is_none())
    throw ConfigError(hooks::is_wrapper(type)
                          ? "smp: built-in hook '" + name + "' wraps another hook: pass inner="
                          : "smp: built-in hook '" + name + "' takes no inner hook");
  if (py::isinstance<py::str>(inner)) inner = py::cast(make_builtin(inner.cast<std::string>(), py::none()));
  return BuiltinHook{type, std::move(inner)};
}

std::string display_name(const BuiltinHook& h) {
  return hooks::is_wrapper(h.type) ? h.name() : h.name() + "_hook";
}

py::dict stats_dict(const ReducerStats& s) {
  py::dict d;
  d["steps"] = s.steps;
  d["buckets"] = s.buckets;
  d["copy_in_ms"] = s.copy_in_ms;
  d["comm_ms"] = s.comm_ms;
  d["wait_ms"] = s.wait_ms;
  d["write_back_ms"] = s.write_back_ms;
  d["unused_local"] = s.unused_local;
  d["unused_global"] = s.unused_global;
  d["rebuilt"] = s.rebuilt;
  d["redone"] = s.redone;
  d["early_buckets"] = s.early_buckets;
  d["first_launch_s"] = s.first_launch_s;
  return d;
}

}  // namespace

double default_timeout() { return is_initialized() ? runtime().config().timeout_s : 300.0; }

void bind_reducer(py::module_& m) {
  py::class_<GradBucket, std::shared_ptr<GradBucket>>(m, "GradBucket",
      "One bucket of gradients, as a comm hook sees it (torch.distributed.GradBucket).")
      .def("index", &GradBucket::index)
      .def("buffer", &GradBucket::buffer)
      .def("gradients", &GradBucket::gradients)
      .def("is_last", &GradBucket::is_last)
      .def("set_buffer", &GradBucket::set_buffer, py::arg("buffer"))
      .def("parameters", &GradBucket::parameters)
      .def("process_group", &GradBucket::process_group)
      .def("is_shadow", &GradBucket::is_shadow)
      .def("__repr__", [](const GradBucket& b) {
        return str_cat("<smp.GradBucket ", b.index(), "/", b.bucket_count(), ": ",
                       b.parameters().size(), " tensors, ", b.buffer().numel(), " elements>");
      });

  // The closed set of built-ins (hooks/builtin.h), named as torch's DDPCommHookType
  // names them; `hook_name` is the name smp._C.BuiltinHook carries.
  using HookType = hooks::BuiltinCommHookType;
  py::enum_<HookType>(m, "BuiltinCommHookType",
      "The built-in comm hooks smp runs in C++ (c10d's BuiltinCommHookType, extended).")
      .value("ALLREDUCE", HookType::kAllreduce)
      .value("FP16_COMPRESS", HookType::kFp16Compress)
      .value("BF16_COMPRESS", HookType::kBf16Compress)
      .value("NOOP", HookType::kNoop)
      .value("FP16_COMPRESS_WRAPPER", HookType::kFp16CompressWrapper)
      .value("BF16_COMPRESS_WRAPPER", HookType::kBf16CompressWrapper)
      .value("POWER_SGD", HookType::kPowerSGD)
      .value("BATCHED_POWER_SGD", HookType::kBatchedPowerSGD)
      .value("QUANTIZE_PER_TENSOR", HookType::kQuantizePerTensor)
      .value("QUANTIZE_PER_CHANNEL", HookType::kQuantizePerChannel)
      .def_property_readonly("hook_name", [](HookType t) { return hooks::builtin_hook_name(t); },
                             "The hook's name: 'allreduce', 'powerSGD', ...")
      .def_property_readonly("is_wrapper", [](HookType t) { return hooks::is_wrapper(t); })
      .def_static("from_hook_name", &hooks::builtin_hook_type, py::arg("name"),
                  "The type called `name`; ValueError (smp.ConfigError) naming the allowed "
                  "names if there is none.");

  py::class_<BuiltinHook>(m, "BuiltinHook",
      "A built-in comm hook run in C++. Callable as hook(state, bucket) -> Future; "
      "Reducer.register_comm_hook recognises it and runs it without Python.")
      .def(py::init([](const std::string& name, py::object inner) {
             return make_builtin(name, std::move(inner));
           }),
           py::arg("name"), py::arg("inner") = py::none())
      .def(py::init([](HookType type, py::object inner) {
             return make_builtin(type, std::move(inner));
           }),
           py::arg("type"), py::arg("inner") = py::none())
      .def_property_readonly("name", &BuiltinHook::name)
      .def_readonly("type", &BuiltinHook::type)
      .def_readonly("inner", &BuiltinHook::inner)
      // Like a function's: "allreduce_hook", "fp16_compress_wrapper" (a class cannot
      // define these as properties: they would rename the type).
      .def("__getattr__", [](const BuiltinHook& h, const std::string& attr) -> py::object {
        if (attr == "__name__" || attr == "__qualname__") return py::str(display_name(h));
        throw py::attribute_error("'smp._C.BuiltinHook' object has no attribute '" + attr + "'");
      })
      .def("__call__", [](const BuiltinHook& self, const py::object& state, const py::object& bucket,
                          int64_t channel_size) {
        CommHookPtr hook = builtin_to_comm_hook(state, self, channel_size);
        auto b = bucket.cast<std::shared_ptr<GradBucket>>();
        FuturePtr fut;
        {
          py::gil_scoped_release nogil;
          fut = hook->run(*b);
        }
        auto out = fut->then(
            [hook, b](c10::ivalue::Future& f) -> c10::IValue {
              if (f.hasError()) std::rethrow_exception(f.exception_ptr());
              return hook->result(*b, f.value());
            },
            c10::TensorType::get());
        return std::make_shared<torch::jit::PythonFutureWrapper>(out);
      }, py::arg("state"), py::arg("bucket"), py::arg("channel_size") = 512)
      .def("__eq__", [](const BuiltinHook& a, const py::object& other) {
        if (!py::isinstance<BuiltinHook>(other)) return false;
        const auto& b = other.cast<const BuiltinHook&>();
        return a.type == b.type && (a.inner.is_none() ? b.inner.is_none() : a.inner.equal(b.inner));
      })
      .def("__hash__", [](const BuiltinHook& h) {
        py::object inner = h.inner.is_none() ? py::object(py::none()) : py::object(py::repr(h.inner));
        return py::hash(py::make_tuple(h.name(), inner));
      })
      .def("__repr__", [](const BuiltinHook& h) {
        std::string s = "<smp built-in hook " + display_name(h);
        if (!h.inner.is_none()) s += " of " + py::repr(h.inner).cast<std::string>();
        return s + ">";
      })
      .def(py::pickle(
          // By name, not by enum value: checkpoints keep loading if the enum grows.
          [](const BuiltinHook& h) { return py::make_tuple(h.name(), h.inner); },
          [](const py::tuple& t) {
            return make_builtin(t[0].cast<std::string>(), t[1]);
          }));

  // _C.allreduce_hook, ..., _C.quantization_perchannel_hook: every built-in but the
  // wrappers, which are functions of the hook they wrap.
  for (HookType t : hooks::builtin_hook_types())
    if (!hooks::is_wrapper(t))
      m.attr((hooks::builtin_hook_name(t) + "_hook").c_str()) = make_builtin(t, py::none());
  m.def("fp16_compress_wrapper", [](py::object hook) {
    return make_builtin(HookType::kFp16CompressWrapper, std::move(hook));
  }, py::arg("hook"), "Wraps `hook`: it runs on a float16 copy of the bucket.");
  m.def("bf16_compress_wrapper", [](py::object hook) {
    return make_builtin(HookType::kBf16CompressWrapper, std::move(hook));
  }, py::arg("hook"), "Wraps `hook`: it runs on a bfloat16 copy of the bucket.");
  m.def("builtin_hook_names", &hooks::builtin_hook_names);
  m.def("quiesce_python_hooks", &quiesce_python_hooks, release(), py::arg("timeout_s"),
        "At exit: waits until no Gloo thread still holds a Python comm hook's callback "
        "(Note [Python hooks at exit]); returns how many of the hooks' futures were "
        "still held elsewhere when `timeout_s` ran out.");
  m.def("run_on_torch_bucket", &run_on_torch_bucket, py::arg("hook"), py::arg("state"),
        py::arg("bucket"), py::arg("default_group"), py::arg("queue_group"),
        py::arg("channel_size") = 512,
        "Runs built-in `hook` on torch's GradBucket under torch DDP; returns a Future "
        "(see Note [Built-in hooks under torch DDP] in bind_reducer.cpp).");

  py::class_<Reducer, std::shared_ptr<Reducer>>(m, "Reducer",
      "Averages the gradients of `params` across `process_group` in buckets (docs/reducer.md).")
      .def(py::init([](std::vector<at::Tensor> params, const ProcessGroupPtr& pg,
                       double bucket_cap_mb, bool gradient_as_bucket_view, bool overlapping,
                       std::optional<std::vector<int64_t>> expected_order, double timeout_s,
                       bool shared_memory, std::vector<int> owners, std::vector<int> sliced,
                       const py::object& slice_group, bool prescaled_batch) {
             if (!(bucket_cap_mb > 0))
               throw ConfigError(str_cat("smp: Reducer bucket_cap_mb=", bucket_cap_mb,
                                         " must be > 0"));
             ReducerOptions o;
             o.bucket_cap_bytes = static_cast<size_t>(bucket_cap_mb * 1024 * 1024);
             o.bucket_cap_bytes = std::max<size_t>(o.bucket_cap_bytes, 1);
             o.gradient_as_bucket_view = gradient_as_bucket_view;
             o.overlapping = overlapping;
             if (expected_order) o.expected_order = *expected_order;
             o.timeout_s = timeout_s;
             o.shared_memory = shared_memory;
             o.owners = std::move(owners);
             o.sliced = std::move(sliced);
             if (!slice_group.is_none()) o.slice_group = slice_group.cast<ProcessGroupPtr>();
             o.prescaled_batch = prescaled_batch;
             Reducer* r;
             {
               py::gil_scoped_release nogil;  // the constructor allgathers
               r = new Reducer(std::move(params), pg, std::move(o));
             }
             return std::shared_ptr<Reducer>(r, [](Reducer* p) {
               if (PyGILState_Check()) {
                 py::gil_scoped_release nogil;  // the comm thread may need the GIL
                 delete p;
               } else {
                 delete p;
               }
             });
           }),
           py::arg("params"), py::arg("process_group"), py::arg("bucket_cap_mb") = 25.0,
           py::arg("gradient_as_bucket_view") = false, py::arg("overlapping") = true,
           py::arg("expected_order") = py::none(), py::arg("timeout_s") = 300.0,
           py::arg("shared_memory") = true, py::arg("owners") = std::vector<int>{},
           py::arg("sliced") = std::vector<int>{}, py::arg("slice_group") = py::none(),
           py::arg("prescaled_batch") = false)
      .def("prepare_for_backward", &Reducer::prepare_for_backward, py::arg("sync"),
           py::arg("grad_scale") = 1.0, py::arg("outputs") = std::vector<at::Tensor>{},
           release())
      .def("prepare_for_pipeline_backward", &Reducer::prepare_for_pipeline_backward,
           py::arg("grad_scale") = 1.0, py::arg("hold") = std::vector<int64_t>{}, release())
      .def("finalize", [](Reducer& r) { r.finalize(); }, release())
      .def("run_shadow_step", &Reducer::run_shadow_step, release())
      .def("fail_step", &Reducer::fail_step, release())
      .def("abandon_step", &Reducer::abandon_step, release())
      .def("watch_peer_failures",
           [](Reducer& r, const StorePtr& store, const std::string& prefix, std::vector<int> peers) {
             r.set_peer_probe([store, prefix, peers](int64_t step) {
               const std::string why = posted_failure(store, prefix, peers, step);
               return why.empty() ? why
                                  : str_cat("smp: ", why, "; every rank of the dp group stops "
                                            "here instead of waiting for it");
             });
           },
           py::arg("store"), py::arg("prefix"), py::arg("peers"),
           "Note [Failed peer]: long waits of a reduction ask the store whether one of "
           "`peers` (global ranks) posted that it will not come.")
      .def("set_active_ranks", &Reducer::set_active_ranks, py::arg("n"))
      .def("steps_run", &Reducer::steps_run)
      .def("register_comm_hook", [](Reducer& r, const py::object& state, const py::object& hook) {
        r.register_comm_hook(to_comm_hook(state, hook));
      }, py::arg("state"), py::arg("hook"))
      .def("use_torch_initial_layout", &Reducer::use_torch_initial_layout, release())
      .def("adopt_layout", &Reducer::adopt_layout, py::arg("layout"), release())
      .def("register_builtin_hook", [](Reducer& r, const std::string& name, const py::object& state,
                                       const py::object& inner) {
        r.register_comm_hook(to_comm_hook(state, py::cast(make_builtin(name, inner))));
      }, py::arg("name"), py::arg("state") = py::none(), py::arg("inner") = py::none())
      .def("bucket_indices", &Reducer::bucket_indices)
      .def("rebuilt", &Reducer::rebuilt)
      .def("shared_memory", &Reducer::shared_memory)
      .def("sliced", &Reducer::sliced)
      .def_static("check_slices", &Reducer::check_slices, py::arg("sliced"),
                  py::arg("hook") = std::string(),
                  "Raises smp.ConfigError where tp slices meet a comm hook (its name) "
                  "(Note [Slices reduce over their rdp group]).")
      .def("hierarchy", &Reducer::hierarchy)
      .def_property_readonly("hosts_group", &Reducer::hosts_group)
      .def("stats", [](const Reducer& r) { return stats_dict(r.stats()); })
      .def_property_readonly("process_group", &Reducer::process_group);

  py::class_<ShareExchange>(m, "ShareExchange",
      "Broadcasts of tensor lists from their roots, in flight while the caller goes on "
      "(smp_core/reducer.h).")
      .def(py::init([](const ProcessGroupPtr& pg, double bucket_cap_mb, double timeout_s) {
             return std::make_unique<ShareExchange>(
                 pg, static_cast<size_t>(std::max(bucket_cap_mb, 1e-6) * 1024 * 1024), timeout_s);
           }),
           py::arg("process_group"), py::arg("bucket_cap_mb") = 25.0, py::arg("timeout_s") = 300.0)
      .def("start", &ShareExchange::start, py::arg("tensors"), py::arg("root"), release())
      .def("end_round", &ShareExchange::end_round)
      .def("wait", &ShareExchange::wait, py::arg("leave") = 0, release());
  m.def("broadcast_coalesced", [](const ProcessGroupPtr& pg, const std::vector<at::Tensor>& tensors,
                                  int root, double bucket_cap_mb) {
    double timeout = default_timeout();
    py::gil_scoped_release nogil;
    broadcast_coalesced(pg, tensors, root, static_cast<size_t>(bucket_cap_mb * 1024 * 1024),
                        timeout);
  }, py::arg("process_group"), py::arg("tensors"), py::arg("root") = 0,
        py::arg("bucket_cap_mb") = 25.0,
        "Broadcasts `tensors` in place from group rank `root`, flattened per dtype into "
        "chunks of at most bucket_cap_mb.");
}

}  // namespace smp::python
