// smp._C's tensor parallelism: the slices a tp rank holds and the collectives at a
// distributed module's boundaries (smp_core/tensor_parallel.h). smp/nn/distributed.py
// builds the modules on them.
#include <pybind11/stl.h>

#include "bindings.h"
#include "smp_core/tensor_parallel.h"

namespace py = pybind11;

namespace smp::python {

void bind_tp(py::module_& m) {
  m.def("tp_group", [] {
    tp::Group g = tp::current_group();
    return py::make_tuple(g.size, g.rank, g.prescaled_batch);
  }, "(size, rank, prescaled_batch) of this rank's tp group; (1, 0, False) without one");
  m.def("tp_slice", [](const std::string& what, const std::string& cut,
                       const std::vector<int64_t>& full_shape, int size, int rank) {
    tp::Slice s = tp::slice_of(what, tp::parse_cut(cut), full_shape, size, rank);
    return py::make_tuple(s.dim, s.start, s.length);
  }, py::arg("what"), py::arg("cut"), py::arg("full_shape"), py::arg("size"), py::arg("rank"),
     "(dim, start, length) of the part of a weight cut `cut` that tp rank `rank` holds");
  m.def("tp_check_divisible", &tp::check_divisible, py::arg("what"), py::arg("value"),
        py::arg("size"));
  m.def("tp_enter", [](const at::Tensor& x, bool check, const std::string& what) {
    return tp::enter(x, tp::current_group(), check, what);
  }, py::arg("x"), py::arg("check"), py::arg("what"), py::call_guard<py::gil_scoped_release>());
  m.def("tp_leave", [](const at::Tensor& y, const std::string& what) {
    return tp::leave(y, tp::current_group(), what);
  }, py::arg("y"), py::arg("what"), py::call_guard<py::gil_scoped_release>());
  m.def("tp_dropout", [](const at::Tensor& x, double p, bool training,
                         const std::vector<int64_t>& full_shape, int64_t dim, int64_t start,
                         int64_t length) {
    tp::Slice s;
    s.dim = dim;
    s.start = start;
    s.length = length;
    s.full = length == 0 ? 0 : full_shape.at(dim);
    return tp::dropout(x, p, training, full_shape, s);
  }, py::arg("x"), py::arg("p"), py::arg("training"), py::arg("full_shape"), py::arg("dim"),
     py::arg("start"), py::arg("length"));
}

}  // namespace smp::python
