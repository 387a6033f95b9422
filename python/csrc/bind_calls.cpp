// Bindings of the two sides of a remote module call: smp::Caller (smp_core/call.h,
// Note [Known calls]) and smp::Server (smp_core/serve.h, Note [Known forward
// requests]), and the metadata's encoder (smp_core/call_meta.h). They convert between
// Python objects and the C++ types; the structures only Python can pickle go through
// the functions smp/remote_call.py and smp/pipeline.py hand over.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <pybind11/stl.h>

#include "bindings.h"
#include "smp_core/call.h"
#include "smp_core/call_meta.h"
#include "smp_core/dispatch.h"
#include "smp_core/serve.h"

namespace py = pybind11;

namespace smp::python {
namespace {

py::object wrap(const at::Tensor& t) {
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(t));
}

py::list wrap_all(const std::vector<at::Tensor>& ts) {
  py::list out(ts.size());
  for (size_t i = 0; i < ts.size(); ++i) out[i] = wrap(ts[i]);
  return out;
}

py::object bytes_or_none(const std::string& s) {
  return s.empty() ? py::object(py::none()) : py::object(py::bytes(s));
}

// A call's Python arguments as they travel (smp_core/call.h CallArgs): distinct tensors
// passed positionally as they are; anything else (keyword arguments, other objects,
// nesting, a tensor passed twice) as `flatten(args, kwargs) -> (skeleton, tensors)`.
CallArgs to_call_args(const py::tuple& args, const py::dict& kwargs, const py::object& flatten) {
  CallArgs out;
  bool positional = kwargs.empty();
  const size_t n = args.size();
  for (size_t i = 0; positional && i < n; ++i) {
    PyObject* a = PyTuple_GET_ITEM(args.ptr(), i);
    positional = THPVariable_Check(a);
    for (size_t j = 0; positional && j < i; ++j) positional = PyTuple_GET_ITEM(args.ptr(), j) != a;
  }
  if (positional) {
    out.tensors.reserve(n);
    for (size_t i = 0; i < n; ++i)
      out.tensors.push_back(THPVariable_Unpack(PyTuple_GET_ITEM(args.ptr(), i)));
    return out;
  }
  auto t = flatten(args, kwargs).cast<py::tuple>();
  out.skeleton = t[0].cast<std::string>();
  out.tensors = t[1].cast<std::vector<at::Tensor>>();
  return out;
}

// smp::Caller with the Python functions that (un)pickle a call's structure.
struct PyCaller {
  std::shared_ptr<Caller> caller;
  py::object flatten;    // (args, kwargs) -> (skeleton bytes, tensors)
  py::object unflatten;  // (skeleton bytes, tensors) -> what the module returned

  py::object call(const std::string& module, int owner, const py::tuple& args,
                  const py::dict& kwargs, const py::bytes& mode_flags) {
    CallArgs in = to_call_args(args, kwargs, flatten);
    CallOutputs out;
    try {
      py::gil_scoped_release nogil;
      out = caller->call(module, owner, std::move(in), mode_flags);
    } catch (python_error& e) {  // an error answer, rebuilt by Python (ErrorRaiser)
      e.restore();
      throw py::error_already_set();
    }
    if (out.skeleton.empty()) return wrap(out.tensors.at(0));
    return unflatten(py::bytes(out.skeleton), wrap_all(out.tensors));
  }
};

// The Python exception `error` is, or a RuntimeError with a C++ error's text.
py::object exception_object(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (python_error& pe) {
    pe.restore();
    py::error_already_set fetched;
    return fetched.value();
  } catch (py::error_already_set& pe) {
    py::object exc = pe.value();
    // Its traceback, as an `except` clause would see it.
    if (pe.trace() && !pe.trace().is_none()) PyException_SetTraceback(exc.ptr(), pe.trace().ptr());
    return exc;
  } catch (const std::exception& other) {
    return py::module_::import("builtins").attr("RuntimeError")(other.what());
  } catch (...) {
    return py::module_::import("builtins").attr("RuntimeError")("smp: an unknown C++ error");
  }
}

// Server's hooks (smp_core/serve.h ServeHooks) over two Python functions:
// run(module, mb, mode_flags or None, args list, skeleton or None) -> (out, modes_changed)
// where `out` is a tensor or (skeleton bytes, tensors); encode_failure(exc, mb, backward)
// -> bytes.
ServeHooks serve_hooks(py::function run, py::function encode_failure) {
  auto r = share(std::move(run));
  auto f = share(std::move(encode_failure));
  ServeHooks hooks;
  hooks.run = [r](const ModuleCall& call) {
    py::gil_scoped_acquire gil;
    py::object got = (*r)(call.module, call.mb,
                          call.mode_flags ? py::object(py::bytes(*call.mode_flags)) : py::none(),
                          wrap_all(call.args), bytes_or_none(call.skeleton));
    ModuleResult result;
    try {
      auto pair = got.cast<py::tuple>();
      py::object out = pair[0];
      result.modes_changed = pair[1].cast<bool>();
      if (THPVariable_Check(out.ptr())) {
        result.outputs.push_back(THPVariable_Unpack(out.ptr()));
      } else {
        auto structured = out.cast<py::tuple>();
        result.skeleton = structured[0].cast<std::string>();
        result.outputs = structured[1].cast<std::vector<at::Tensor>>();
      }
    } catch (const py::builtin_exception&) {  // cast_error
      throw std::runtime_error("smp: the serving hook returned " +
                               std::string(py::str(py::repr(got))) +
                               ", not (tensor or (skeleton, tensors), modes_changed)");
    }
    return result;
  };
  hooks.encode_failure = [f](std::exception_ptr error, int64_t mb, bool backward) {
    py::gil_scoped_acquire gil;
    py::object exc = exception_object(error);
    return (*f)(exc, mb, backward).cast<std::string>();
  };
  return hooks;
}

}  // namespace

py::object python_exception(std::exception_ptr error) { return exception_object(error); }

void bind_calls(py::module_& m) {
  // Note [Known calls] (smp_core/call.h).
  py::class_<PyCaller, std::shared_ptr<PyCaller>>(m, "Caller")
      .def(py::init([](std::shared_ptr<Dispatcher> dispatcher, int64_t id_base,
                       py::object flatten, py::object unflatten) {
             auto caller = std::make_shared<Caller>(std::move(dispatcher), id_base);
             return python_owned(
                 new PyCaller{std::move(caller), std::move(flatten), std::move(unflatten)});
           }),
           py::arg("dispatcher"), py::arg("id_base"), py::arg("flatten"), py::arg("unflatten"))
      .def("__call__", &PyCaller::call, py::arg("module"), py::arg("owner"), py::arg("args"),
           py::arg("kwargs"), py::arg("mode_flags"))
      .def("begin_step", [](PyCaller& c) { c.caller->begin_step(); })
      .def("close", [](PyCaller& c) { c.caller->close(); })
      .def_property_readonly("fast_calls",
                             [](const PyCaller& c) { return c.caller->fast_calls(); });
  // Note [Known forward requests] (smp_core/serve.h).
  py::class_<Server, std::shared_ptr<Server>>(m, "Server")
      .def(py::init([](py::function run, py::function encode_failure, int pp_rank) {
             return std::make_shared<Server>(serve_hooks(std::move(run), std::move(encode_failure)),
                                             pp_rank);
           }),
           py::arg("run"), py::arg("encode_failure"), py::arg("pp_rank"))
      .def("begin_step", &Server::begin_step)
      .def_property_readonly("served", &Server::served)
      .def("__len__", &Server::known);
  // Note [Call metadata] (smp_core/call_meta.h): the one encoder, for Python's tools and
  // tests (smp/remote_call.py).
  m.def("call_args",
        [](const py::tuple& args, const py::dict& kwargs, const py::object& flatten) {
          CallArgs a = to_call_args(args, kwargs, flatten);
          return py::make_tuple(bytes_or_none(a.skeleton), a.tensors);
        },
        py::arg("args"), py::arg("kwargs"), py::arg("flatten"));
  m.def("encode_request",
        [](const std::string& module, std::vector<bool> requires_grad, bool grad,
           const py::bytes& mode_flags, std::optional<py::bytes> skeleton) {
          RequestMeta meta{module, grad, mode_flags, std::move(requires_grad),
                           skeleton ? std::string(*skeleton) : std::string()};
          return py::bytes(encode_request(meta));
        },
        py::arg("module"), py::arg("requires_grad"), py::arg("grad"), py::arg("mode_flags"),
        py::arg("skeleton"));
  m.def("decode_request",
        [](const py::bytes& bytes) {
          RequestMeta meta = decode_request(bytes, kAnyCount, "a request");
          return py::make_tuple(meta.module, meta.requires_grad, meta.grad,
                                py::bytes(meta.mode_flags), bytes_or_none(meta.skeleton));
        },
        py::arg("meta"));
  m.def("encode_answer",
        [](std::vector<bool> requires_grad, std::optional<py::bytes> skeleton) {
          AnswerMeta meta{std::move(requires_grad),
                          skeleton ? std::string(*skeleton) : std::string()};
          return py::bytes(encode_answer(meta));
        },
        py::arg("requires_grad"), py::arg("skeleton"));
  m.def("decode_answer",
        [](const py::bytes& bytes) {
          AnswerMeta meta = decode_answer(bytes, kAnyCount, "an answer");
          return py::make_tuple(meta.requires_grad, bytes_or_none(meta.skeleton));
        },
        py::arg("meta"));
}

}  // namespace smp::python
