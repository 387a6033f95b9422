// Writing checkpoint files: the zip torch.save writes, produced here from records the
// caller pickled (smp/checkpoint/_torch_save.py), with the entry table and the trailer
// computed as the bytes go out, then fsync; and the background writer that does this
// for an asynchronous save. See Note [One writer] in writer.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/manifest.h"

namespace smp::checkpoint {

// One record of the zip: its name without the archive prefix ("data.pkl", "data/0")
// and its bytes (a contiguous CPU tensor; read, never written).
struct Blob {
  std::string name;
  at::Tensor bytes;
};

// Writes `records` in order as a torch zip to `tmp_path` (created; the directory must
// exist), then the entry table, then the trailer of `m` (whose payload and entry
// fields this fills), then fsyncs the file. Throws CheckpointError naming the file.
void write_sealed(const std::string& tmp_path, const std::vector<Blob>& records, Manifest& m);

struct SaveJob {
  std::vector<Blob> records;
  std::string tmp_path;
  std::string final_path;
  Manifest manifest;
  bool publish = true;         // rename onto final_path once sealed (else the caller does)
  bool keep_previous = false;  // publish's keep_previous (Note [Generations])
};

// A thread that writes SaveJobs one after another, in submission order. Jobs are
// numbered from 1; a job's outcome (empty: written, else the error) is kept until the
// writer goes. Thread-safe. The destructor finishes every job submitted.
class Writer {
 public:
  Writer();
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  uint64_t submit(SaveJob job);
  // True once job `id` finished (then *error is its outcome); false when `timeout`
  // passed first. A zero timeout polls.
  bool wait(uint64_t id, std::chrono::milliseconds timeout, std::string* error);
  // Waits for every job submitted so far (at exit: nothing half-written is left
  // behind but uncommitted temporaries, which no reader looks at).
  void flush();

 private:
  void run();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<uint64_t, SaveJob>> queue_;
  std::map<uint64_t, std::string> errors_;
  uint64_t submitted_ = 0;
  uint64_t finished_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

// The process's writer (started on first use).
Writer& background_writer();

}  // namespace smp::checkpoint
