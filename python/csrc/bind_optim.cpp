// smp._C.optim: the fused optimizers' steps (smp_core/optim/), for
// smp.optimizers.FusedLamb and FusedNovoGrad (python/smp/optimizers.py). The kernels
// run with the GIL released, on torch's intra-op threads.
#include <pybind11/stl.h>

#include "bindings.h"
#include "smp_core/optim/lamb.h"
#include "smp_core/optim/norms.h"
#include "smp_core/optim/novograd.h"

namespace py = pybind11;

namespace smp::python {

void bind_optim(py::module_& m) {
  using optim::LambOptions;
  using optim::NovoGradNorm;
  using optim::NovoGradOptions;
  auto sub = m.def_submodule("optim", "fused optimizer steps (C++)");

  const LambOptions lamb;
  py::class_<LambOptions>(sub, "LambOptions")
      .def(py::init([](double lr, double beta1, double beta2, double eps, double weight_decay,
                       bool bias_correction, bool grad_averaging, bool adam_w_mode,
                       bool use_nvlamb, double max_grad_norm) {
             LambOptions o{lr, beta1, beta2, eps, weight_decay, bias_correction,
                           grad_averaging, adam_w_mode, use_nvlamb, max_grad_norm};
             optim::validate(o);
             return o;
           }),
           py::arg("lr") = lamb.lr, py::arg("beta1") = lamb.beta1, py::arg("beta2") = lamb.beta2,
           py::arg("eps") = lamb.eps, py::arg("weight_decay") = lamb.weight_decay,
           py::arg("bias_correction") = lamb.bias_correction,
           py::arg("grad_averaging") = lamb.grad_averaging,
           py::arg("adam_w_mode") = lamb.adam_w_mode, py::arg("use_nvlamb") = lamb.use_nvlamb,
           py::arg("max_grad_norm") = lamb.max_grad_norm,
           "Validated options (smp.ConfigError names the first one out of range).");
  // The norm as a tensor first: a 0-d tensor would otherwise convert to a float (and
  // sync a device).
  using Tensors = std::vector<at::Tensor>;
  using LambStep = void (*)(const Tensors&, const Tensors&, const Tensors&, const Tensors&,
                            const std::vector<int64_t>&, const at::Tensor&, const LambOptions&);
  using LambStepHost = void (*)(const Tensors&, const Tensors&, const Tensors&, const Tensors&,
                                const std::vector<int64_t>&, double, const LambOptions&);
  sub.def("lamb_step", static_cast<LambStep>(&optim::lamb_step), py::arg("params"),
          py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("steps"),
          py::arg("global_grad_norm"), py::arg("options"),
          py::call_guard<py::gil_scoped_release>(),
          "One LAMB step of a parameter group, in place, on any device; the norm a "
          "one-element tensor or a float (smp_core/optim/lamb.h).");
  sub.def("lamb_step", static_cast<LambStepHost>(&optim::lamb_step), py::arg("params"),
          py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("steps"),
          py::arg("global_grad_norm"), py::arg("options"),
          py::call_guard<py::gil_scoped_release>());

  const NovoGradOptions novo;
  py::class_<NovoGradOptions>(sub, "NovoGradOptions")
      .def(py::init([](double lr, double beta1, double beta2, double eps, double weight_decay,
                       bool bias_correction, bool grad_averaging, bool reg_inside_moment,
                       int norm_type, bool init_zero) {
             NovoGradOptions o{lr, beta1, beta2, eps, weight_decay, bias_correction,
                               grad_averaging, reg_inside_moment,
                               static_cast<NovoGradNorm>(norm_type), init_zero};
             optim::validate(o);
             return o;
           }),
           py::arg("lr") = novo.lr, py::arg("beta1") = novo.beta1, py::arg("beta2") = novo.beta2,
           py::arg("eps") = novo.eps, py::arg("weight_decay") = novo.weight_decay,
           py::arg("bias_correction") = novo.bias_correction,
           py::arg("grad_averaging") = novo.grad_averaging,
           py::arg("reg_inside_moment") = novo.reg_inside_moment,
           py::arg("norm_type") = static_cast<int>(novo.norm_type),
           py::arg("init_zero") = novo.init_zero,
           "Validated options; norm_type 2 (L2) or 0 (infinity), as apex's.");
  sub.def("novograd_step", &optim::novograd_step, py::arg("params"), py::arg("grads"),
          py::arg("exp_avgs"), py::arg("grad_norms"), py::arg("steps"), py::arg("options"),
          py::call_guard<py::gil_scoped_release>(),
          "One NovoGrad step of a parameter group, in place (smp_core/optim/novograd.h).");

  sub.def("sum_of_squares", &optim::sum_of_squares, py::arg("tensors"),
          py::call_guard<py::gil_scoped_release>(),
          "Sum of x^2 over every element of every tensor, in double (smp_core/optim/norms.h).");
  sub.def("sum_of_squares_tensor", &optim::sum_of_squares_tensor, py::arg("tensors"),
          py::call_guard<py::gil_scoped_release>(),
          "The same sum as a 0-d float64 tensor on the tensors' device, any device "
          "(smp_core/optim/norms.h).");
}

}  // namespace smp::python
