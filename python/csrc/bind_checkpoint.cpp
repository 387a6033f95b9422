// Bindings of smp::checkpoint: smp._C.CheckpointError, Manifest and the file
// operations smp/checkpoint/ builds smp.save/smp.load on. Every file operation
// releases the GIL (they read, hash and fsync whole files).
#include <torch/csrc/autograd/python_variable.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/mapped.h"
#include "checkpoint/parts.h"
#include "checkpoint/writer.h"

namespace py = pybind11;

namespace smp::python {

void bind_checkpoint(py::module_& m) {
  using namespace smp::checkpoint;
  using release = py::call_guard<py::gil_scoped_release>;
  static py::exception<CheckpointError> checkpoint_error(m, "CheckpointError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CheckpointError& e) {
      PyErr_SetString(checkpoint_error.ptr(), e.what());
    }
  });
  m.attr("CHECKPOINT_FORMAT_VERSION") = kFormatVersion;

  py::class_<Manifest>(m, "Manifest")
      .def(py::init<>())
      .def_readwrite("format_version", &Manifest::format_version)
      .def_readwrite("save_id", &Manifest::save_id)
      .def_readwrite("save_time_ns", &Manifest::save_time_ns)
      .def_readwrite("partial", &Manifest::partial)
      .def_readwrite("part", &Manifest::part)
      .def_readwrite("parts", &Manifest::parts)
      .def_readwrite("world_size", &Manifest::world_size)
      .def_readwrite("pp_size", &Manifest::pp_size)
      .def_readwrite("dp_size", &Manifest::dp_size)
      .def_readwrite("plan_hash", &Manifest::plan_hash)
      .def_readwrite("payload_size", &Manifest::payload_size)
      .def_readwrite("payload_hash", &Manifest::payload_hash)
      .def_readwrite("torch_version", &Manifest::torch_version)
      .def_readonly("entries_offset", &Manifest::entries_offset)
      .def_readonly("entries_size", &Manifest::entries_size)
      .def_readonly("entry_chunk", &Manifest::entry_chunk)
      .def("describe", &Manifest::describe)
      .def("__repr__", [](const Manifest& mf) { return "<smp checkpoint " + mf.describe() + ">"; });

  m.def("checkpoint_seal", [](const std::string& tmp, Manifest mf) {
    seal(tmp, mf);
    return mf;
  }, release(), py::arg("tmp_path"), py::arg("manifest"),
        "Hashes the torch zip at tmp_path, appends the manifest, fsyncs; returns the manifest.");
  m.def("checkpoint_publish", &publish, release(), py::arg("tmp_path"), py::arg("final_path"),
        py::arg("keep_previous"));
  m.def("checkpoint_drop_previous", &drop_previous, release(), py::arg("final_path"));
  m.def("checkpoint_write_file_atomic", [](const std::string& path, const py::bytes& b) {
    std::string s = b;
    py::gil_scoped_release nogil;
    write_file_atomic(path, s);
  }, py::arg("path"), py::arg("data"));
  m.def("checkpoint_read_manifest", &read_manifest, release(), py::arg("path"));
  m.def("checkpoint_has_manifest", &has_manifest, release(), py::arg("path"));
  m.def("checkpoint_read_verified", [](const std::string& path) {
    VerifiedFile vf;
    {
      py::gil_scoped_release nogil;
      vf = read_verified(path);
    }
    py::dict records;
    for (auto& r : vf.records) records[py::str(r.name)] = r.bytes;
    return py::make_tuple(vf.manifest, records);
  }, py::arg("path"), "Reads and verifies a whole file: (manifest, {record name: uint8 tensor}).");
  m.def("checkpoint_verify", &verify, release(), py::arg("path"),
        "Checks a whole file against its manifest, keeping none of it; returns the manifest.");
  m.def("checkpoint_order_parts", &order_parts, release(), py::arg("paths"),
        "The files of one partial save in part order; CheckpointError if they are not.");
  m.def("checkpoint_read_parts", [](const std::vector<std::string>& paths) {
    std::vector<VerifiedFile> files;
    {
      py::gil_scoped_release nogil;
      files = read_parts(paths);
    }
    py::list out;
    for (auto& vf : files) {
      py::dict records;
      for (auto& r : vf.records) records[py::str(r.name)] = r.bytes;
      out.append(py::make_tuple(vf.manifest, records));
    }
    return out;
  }, py::arg("paths"),
        "order_parts, then every part read and verified: [(manifest, records)] in part order.");
  // Note [One writer] in checkpoint/writer.cpp: records are (name, uint8 CPU tensor).
  auto blobs = [](const std::vector<std::pair<std::string, at::Tensor>>& records) {
    std::vector<Blob> out;
    out.reserve(records.size());
    for (const auto& [name, t] : records) out.push_back({name, t});
    return out;
  };
  m.def("checkpoint_write", [blobs](const std::string& tmp,
                                    const std::vector<std::pair<std::string, at::Tensor>>& records,
                                    Manifest mf) {
    auto b = blobs(records);
    py::gil_scoped_release nogil;
    write_sealed(tmp, b, mf);
    return mf;
  }, py::arg("tmp_path"), py::arg("records"), py::arg("manifest"),
        "Writes the records as a sealed torch zip at tmp_path (fsynced); returns the manifest.");
  m.def("checkpoint_submit", [blobs](const std::vector<std::pair<std::string, at::Tensor>>& records,
                                     const std::string& tmp, const std::string& final_path,
                                     Manifest mf, bool publish, bool keep_previous) {
    SaveJob job{blobs(records), tmp, final_path, std::move(mf), publish, keep_previous};
    py::gil_scoped_release nogil;
    return background_writer().submit(std::move(job));
  }, py::arg("records"), py::arg("tmp_path"), py::arg("final_path"), py::arg("manifest"),
        py::arg("publish"), py::arg("keep_previous"),
        "Queues a write (and rename) on the background writer; returns the job's number.");
  m.def("checkpoint_wait", [](uint64_t id, double timeout_s) {
    std::string error;
    bool done;
    {
      py::gil_scoped_release nogil;
      done = background_writer().wait(
          id, std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)), &error);
    }
    return py::make_tuple(done, error);
  }, py::arg("job"), py::arg("timeout_s"),
        "(finished, error) of a background write; error is empty when it succeeded.");
  m.def("checkpoint_flush", [] { background_writer().flush(); }, release(),
        "Waits for every background write submitted so far.");
  py::class_<MappedFile>(m, "CheckpointFile")
      .def(py::init<const std::string&>(), release(), py::arg("path"))
      .def_property_readonly("path", &MappedFile::path)
      .def_property_readonly("manifest", &MappedFile::manifest)
      .def("names", [](const MappedFile& f) {
        std::vector<std::string> out;
        for (const auto& e : f.entries()) out.push_back(e.name);
        return out;
      })
      .def("size_of", [](const MappedFile& f, const std::string& name) {
        for (const auto& e : f.entries()) if (e.name == name) return e.size;
        throw CheckpointError("smp: checkpoint '" + f.path() + "': no record '" + name + "'");
      })
      .def("has", &MappedFile::has)
      .def("record", &MappedFile::record, py::arg("name"))
      .def("verify", &MappedFile::verify, release(), py::arg("name"))
      .def("verified", &MappedFile::verified, py::arg("name"));
  m.def("checkpoint_bytes_read", &MappedFile::bytes_read,
        "Bytes read and verified by entry in this process (trailers, tables, records).");
  m.def("checkpoint_name", &checkpoint_name, py::arg("path"));
  m.def("checkpoint_resolve_partial", &resolve_partial, release(), py::arg("base"),
        "The newest complete partial save at base_0..: (paths by part, part 0's manifest).");
}

}  // namespace smp::python
