// Bindings of the caller's side of a remote module call (smp/pipeline.py Engine.call).
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <mutex>
#include <unordered_map>

#include <pybind11/stl.h>

#include "bindings.h"
#include "smp_core/dispatch.h"
#include "smp_core/remote_call.h"

namespace py = pybind11;

namespace smp::python {
namespace {

// Note [Known calls]
// ~~~~~~~~~~~~~~~~~~
// The caller's mirror of Note [Known forward requests] (bind_pipeline.cpp). On the
// driver every call of a module another pp rank owns is on the critical path, and its
// Python glue cost ~100 us: the subtree's mode flags, the request's metadata, the call
// id, the request Message, the answer's decoding and the autograd node
// (pipeline.py Engine._call_python, remote_call.Call). A call repeats every microbatch
// and every step with the same shape: tensors passed positionally (each once), the
// same requires-grad flags, grad mode and mode flags, and one tensor back. `Calls`
// makes that call in C++: it reads the flags itself, keys the request's metadata by
// them (encoded by Python the first time: remote_call.encode_request, so the bytes are
// the ones the Python path sends, and the owner's Note [Known forward requests] entry
// matches), numbers the call, sends it and waits with the GIL released, and connects
// the answer to its autograd node. Anything else (keyword arguments, a non-tensor
// argument, a tensor passed twice, no microbatch, the timeline on) goes to Python's
// path, which takes its call id from the same counter. An ERROR or ABORT answer is
// raised by Python (Engine._raise_answer), as on its path; an answer that is not one
// tensor is decoded and rebuilt by Python. The counter is the one source of call ids:
// per microbatch, from 0, offset by the pp rank (ids are unique per caller and
// microbatch: Note [Remote call node]).
//
// Thread-safety: every entry point holds the GIL except the wait for the answer;
// `ids` has a lock of its own (Python's path takes ids too).
class Calls {
 public:
  struct Helpers {
    py::object engine;          // its _call_python, _raise_answer and subtrees
    py::object task;            // smp.task.current: `mb` and `backward` are the thread's
    py::object encode_request;  // remote_call.encode_request
    py::object decode;          // remote_call.decode (an answer's (skeleton, requires_grad))
    py::object unflatten;       // (skeleton, outputs) -> what the module returned
    at::Tensor anchor;          // remote_call.anchor()
    std::string one_tensor[2];  // remote_call.ONE_TENSOR, by requires_grad
  };

  Calls(std::shared_ptr<Dispatcher> dispatcher, Helpers helpers, int64_t id_base)
      : dispatcher_(std::move(dispatcher)), py_(std::move(helpers)), id_base_(id_base) {}

  // The next call id of microbatch `mb` on this rank.
  int64_t next_id(int64_t mb) {
    std::lock_guard<std::mutex> lock(ids_mu_);
    return id_base_ + next_[mb]++;
  }
  void clear_ids() {
    std::lock_guard<std::mutex> lock(ids_mu_);
    next_.clear();
  }

  py::object call(const std::string& name, int owner, const py::tuple& args,
                  const py::dict& kwargs) {
    if (!py_.engine)
      throw std::runtime_error("smp: module '" + name + "' was called after its pipeline "
                               "engine shut down");
    auto fallback = [&] { return py_.engine.attr("_call_python")(name, owner, args, kwargs); };
    if (!enabled || kwargs.size() != 0) return fallback();
    const py::object mb_obj = py_.task.attr("mb");
    if (mb_obj.is_none()) return fallback();
    const size_t n = args.size();
    std::vector<at::Tensor> tensors;
    tensors.reserve(n);
    const bool grad = at::GradMode::is_enabled();
    std::string key;
    key.reserve(n + 1 + 16);
    for (size_t i = 0; i < n; ++i) {
      PyObject* a = PyTuple_GET_ITEM(args.ptr(), i);
      if (!THPVariable_Check(a)) return fallback();
      for (size_t j = 0; j < i; ++j)
        if (PyTuple_GET_ITEM(args.ptr(), j) == a) return fallback();  // passed twice
      tensors.push_back(THPVariable_Unpack(a));
      key.push_back(tensors.back().requires_grad() ? '\1' : '\0');
    }
    key.push_back(grad ? '\1' : '\0');
    Route& route = route_of(name);
    for (const py::object& m : route.subtree) {  // placement.mode_flags
      const int on = PyObject_IsTrue(m.attr("training").ptr());
      if (on < 0) throw py::error_already_set();
      key.push_back(on ? '\1' : '\0');
    }
    auto meta = route.metas.find(key);
    if (meta == route.metas.end()) {
      const std::string flags = key.substr(n + 1);
      std::string bytes = py_.encode_request(name, args, py::dict(), py::list(), grad,
                                             py::bytes(flags))
                              .cast<std::string>();
      meta = route.metas.emplace(key, std::move(bytes)).first;
    }

    Message request;
    request.mb = mb_obj.cast<int64_t>();
    request.call_id = next_id(request.mb);
    request.kind = kRequest;
    request.meta = meta->second;
    request.tensors.reserve(n);
    for (const at::Tensor& t : tensors) request.tensors.push_back(t.detach());
    const int backward = PyObject_IsTrue(py_.task.attr("backward").ptr());
    if (backward < 0) throw py::error_already_set();
    const std::string what = "the output of '" + name + "' (microbatch " +
                             std::to_string(request.mb) + ", call " +
                             std::to_string(request.call_id) + ") from pp rank " +
                             std::to_string(owner);
    const int64_t mb = request.mb, call_id = request.call_id;
    Message answer;
    {
      py::gil_scoped_release nogil;
      answer = dispatcher_->call(owner, std::move(request), kResponse, backward != 0, what);
    }
    if (answer.kind == kError || answer.kind == kAbort) {
      py_.engine.attr("_raise_answer")(py::bytes(answer.meta));
      throw std::runtime_error("smp: " + what + " was an error answer that raised nothing");
    }

    std::vector<bool> requires_grad;
    py::object skeleton;  // none: one tensor
    if (answer.tensors.size() == 1 && answer.meta == py_.one_tensor[0]) {
      requires_grad = {false};
    } else if (answer.tensors.size() == 1 && answer.meta == py_.one_tensor[1]) {
      requires_grad = {true};
    } else {
      auto decoded = py_.decode(py::bytes(answer.meta)).cast<py::tuple>();
      skeleton = decoded[0];
      requires_grad = decoded[1].cast<std::vector<bool>>();
    }
    std::vector<at::Tensor> outs = std::move(answer.tensors);
    if (grad) {
      std::vector<at::Tensor> inputs;
      inputs.reserve(n + 1);
      inputs.push_back(py_.anchor);
      inputs.insert(inputs.end(), tensors.begin(), tensors.end());
      outs = connect_remote_call(dispatcher_, RemoteCallId{owner, mb, call_id, name}, inputs,
                                 std::move(outs), requires_grad);
    }
    ++fast_calls;
    if (!skeleton) return py::reinterpret_steal<py::object>(THPVariable_Wrap(outs[0]));
    return py_.unflatten(skeleton, outs);
  }

  // Drops the Python objects and the dispatcher (Engine.shutdown: they hold the engine).
  void close() {
    enabled = false;
    dispatcher_.reset();
    routes_.clear();
    py_ = Helpers{};
  }

  bool enabled = true;     // off while the timeline records (Python's path has its spans)
  int64_t fast_calls = 0;  // calls made here, not by Python's path

 private:
  struct Route {
    std::vector<py::object> subtree;                     // engine.subtrees[name]
    std::unordered_map<std::string, std::string> metas;  // flags key -> request metadata
  };

  Route& route_of(const std::string& name) {
    auto it = routes_.find(name);
    if (it != routes_.end()) return it->second;
    Route r;
    const py::object subtrees = py_.engine.attr("subtrees");
    for (py::handle m : subtrees[py::str(name)])
      r.subtree.push_back(py::reinterpret_borrow<py::object>(m));
    return routes_.emplace(name, std::move(r)).first->second;
  }

  std::shared_ptr<Dispatcher> dispatcher_;
  Helpers py_;
  const int64_t id_base_;
  std::unordered_map<std::string, Route> routes_;
  std::mutex ids_mu_;
  std::unordered_map<int64_t, int64_t> next_;
};

}  // namespace

void bind_calls(py::module_& m) {
  // Note [Known calls].
  py::class_<Calls, std::shared_ptr<Calls>>(m, "Calls")
      .def(py::init([](std::shared_ptr<Dispatcher> dispatcher, py::object engine,
                       py::object task, py::object encode_request, py::object decode,
                       py::object unflatten, at::Tensor anchor, const py::bytes& one_tensor,
                       const py::bytes& one_tensor_grad, int64_t id_base) {
             Calls::Helpers h{std::move(engine), std::move(task), std::move(encode_request),
                              std::move(decode), std::move(unflatten), std::move(anchor),
                              {one_tensor, one_tensor_grad}};
             return python_owned(new Calls(std::move(dispatcher), std::move(h), id_base));
           }),
           py::arg("dispatcher"), py::arg("engine"), py::arg("task"),
           py::arg("encode_request"), py::arg("decode"), py::arg("unflatten"),
           py::arg("anchor"), py::arg("one_tensor"), py::arg("one_tensor_grad"),
           py::arg("id_base"))
      .def("__call__", &Calls::call, py::arg("name"), py::arg("owner"), py::arg("args"),
           py::arg("kwargs"))
      .def("next_id", &Calls::next_id, py::arg("mb"))
      .def("clear_ids", &Calls::clear_ids)
      .def("close", &Calls::close)
      .def_readwrite("enabled", &Calls::enabled)
      .def_readonly("fast_calls", &Calls::fast_calls);
}

}  // namespace smp::python
