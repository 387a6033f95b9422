#include "checkpoint/writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <c10/util/Exception.h>
#include <caffe2/serialize/inline_container.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>

#include "checkpoint/checkpoint.h"
#include "checkpoint/detail/hash.h"
#include "checkpoint/detail/trailer.h"
#include "checkpoint/entries.h"
#include "smp_core/errors.h"

namespace smp::checkpoint {
namespace {

using detail::Hasher;

// Note [One writer]
// ~~~~~~~~~~~~~~~~~
// Every smp checkpoint file is written here, synchronous or not: Python pickles the
// object with torch's own `_save` into records (the pickle, and each storage's bytes
// as a tensor, smp/checkpoint/_torch_save.py), and this writes them with torch's zip
// writer (PyTorchStreamWriter, so torch.load reads the file as ever). The bytes pass
// through one Sink on their way to the file, which in the same pass
//   - hashes the payload (XXH3-64 of every byte but the last two, the zip comment
//     length, as version 1 did: a whole-file check still works), and
//   - hashes each record in kEntryChunk pieces and notes its offset: the entry table,
//     written as one more record, lets a reader verify only the records it keeps.
// So the data is read from memory once, while it is in cache, and never read back
// from the file. torch's own crc32 of each record (~1 GB/s: 70% of a torch.save of
// 100 MB here) is skipped where this torch's writer allows it: smp's hashes verify
// more, and torch since 2.x loads records whose crc32 is 0.
// An asynchronous save runs the same function on the Writer's thread, after Python
// staged a copy of the tensors (smp/checkpoint/_async.py).
constexpr size_t kSlice = size_t{4} << 20;  // written, then hashed while in cache
static_assert(kEntryChunk % kSlice == 0, "a slice never straddles two chunks");

class Sink {
 public:
  Sink(int fd, const std::string& path) : fd_(fd), path_(path) {}

  // The record whose data the next writes carry (its bytes are at [p, p + n)).
  void expect(const void* p, uint64_t n) {
    rec_ = static_cast<const char*>(p);
    rec_size_ = n;
    rec_done_ = 0;
    rec_offset_ = 0;
    hashes_.clear();
    chunk_.reset();
  }

  // The finished record's place and chunk hashes.
  Entry entry(const std::string& name) {
    Entry e;
    e.name = name;
    e.offset = rec_size_ == 0 ? pos_ : rec_offset_;
    e.size = rec_size_;
    e.chunk_hashes = rec_size_ == 0 ? std::vector<uint64_t>{detail::hash_of(nullptr, 0)}
                                    : std::move(hashes_);
    rec_ = nullptr;
    return e;
  }

  // PyTorchStreamWriter's writer function. Never reports a short write: an exception
  // cannot cross miniz's C frames, and a short write makes torch's writer throw again
  // from its destructor; the first error is kept and thrown by check() instead.
  size_t write(const void* buf, size_t n) {
    const char* p = static_cast<const char*>(buf);
    for (size_t done = 0; done < n;) {
      size_t k = std::min(kSlice, n - done);
      const bool data = rec_ != nullptr && p + done >= rec_ && p + done < rec_ + rec_size_;
      if (data) {
        const uint64_t at = static_cast<uint64_t>(p + done - rec_);
        if (at == 0) rec_offset_ = pos_;
        k = static_cast<size_t>(std::min<uint64_t>(k, kEntryChunk - at % kEntryChunk));
      }
      put(p + done, k);
      if (data) {
        chunk_.update(p + done, k);
        rec_done_ += k;
        if (rec_done_ % kEntryChunk == 0 || rec_done_ == rec_size_) {
          hashes_.push_back(chunk_.digest());
          chunk_.reset();
        }
      }
      done += k;
    }
    return n;
  }

  void check() const {
    if (!error_.empty()) throw CheckpointError(error_);
  }
  uint64_t size() const { return pos_; }
  uint64_t payload_hash() {
    return payload_.digest();  // the 2 bytes held back are the comment length
  }

 private:
  void put(const char* p, size_t n) {
    if (error_.empty()) {
      try {
        detail::pwrite_all(fd_, p, n, pos_, path_);
      } catch (const CheckpointError& e) {
        error_ = e.what();
      }
    }
    pos_ += n;
    // Every byte but the last two is hashed: hold the last two back.
    if (n >= 2) {
      payload_.update(tail_, tail_n_);
      payload_.update(p, n - 2);
      std::memcpy(tail_, p + n - 2, 2);
      tail_n_ = 2;
    } else if (n == 1) {
      if (tail_n_ == 2) {
        payload_.update(tail_, 1);
        tail_[0] = tail_[1];
        tail_[1] = p[0];
      } else {
        tail_[tail_n_++] = p[0];
      }
    }
  }

  int fd_;
  const std::string& path_;
  uint64_t pos_ = 0;
  Hasher payload_;
  char tail_[2] = {0, 0};
  size_t tail_n_ = 0;
  const char* rec_ = nullptr;
  uint64_t rec_size_ = 0, rec_done_ = 0, rec_offset_ = 0;
  Hasher chunk_;
  std::vector<uint64_t> hashes_;
  std::string error_;
};

using Zip = caffe2::serialize::PyTorchStreamWriter;
using WriterFunc = std::function<size_t(const void*, size_t)>;

// torch's zip writer without its crc32 where this torch has the switch (2.x; 1.13's
// writer always computes it).
std::unique_ptr<Zip> make_zip(WriterFunc f) {
  if constexpr (std::is_constructible_v<Zip, WriterFunc, bool>) {
    return std::make_unique<Zip>(std::move(f), /*compute_crc32=*/false);
  } else {
    return std::make_unique<Zip>(std::move(f));
  }
}

}  // namespace

void write_sealed(const std::string& tmp_path, const std::vector<Blob>& records, Manifest& m) {
  detail::Fd f(::open(tmp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (f.fd < 0) throw CheckpointError(detail::sys_error("cannot create", tmp_path));
  try {
    Sink sink(f.fd, tmp_path);
    std::vector<Entry> entries;
    entries.reserve(records.size());
    {
      auto zip = make_zip([&sink](const void* p, size_t n) { return sink.write(p, n); });
      try {
        for (const auto& r : records) {
          TORCH_CHECK(r.bytes.is_contiguous() && r.bytes.device().is_cpu(), "record ", r.name,
                      " is not a contiguous CPU tensor");
          const auto n = static_cast<size_t>(r.bytes.nbytes());
          sink.expect(r.bytes.data_ptr(), n);
          zip->writeRecord(r.name, r.bytes.data_ptr(), n);
          entries.push_back(sink.entry(r.name));
        }
        const std::string table = encode_entries(entries);
        sink.expect(table.data(), table.size());
        zip->writeRecord(kEntriesRecord, table.data(), table.size());
        const Entry t = sink.entry(kEntriesRecord);
        m.entries_offset = t.offset;
        m.entries_size = t.size;
        m.entries_hash = detail::hash_of(table.data(), table.size());
        m.entry_chunk = kEntryChunk;
        zip->writeEndOfFile();
      } catch (const c10::Error& e) {
        sink.check();  // an I/O error explains it better
        throw CheckpointError(str_cat("smp: checkpoint '", tmp_path, "': ", e.what_without_backtrace()));
      }
    }
    sink.check();
    m.format_version = kFormatVersion;
    m.payload_size = sink.size();
    m.payload_hash = sink.payload_hash();
    detail::append_trailer(f.fd, sink.size(), m, tmp_path);
    if (::fsync(f.fd) != 0) throw CheckpointError(detail::sys_error("fsync failed", tmp_path));
  } catch (...) {
    ::unlink(tmp_path.c_str());
    throw;
  }
}

Writer::Writer() : thread_([this] { run(); }) {}

Writer::~Writer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

uint64_t Writer::submit(SaveJob job) {
  uint64_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = ++submitted_;
    queue_.emplace_back(id, std::move(job));
  }
  cv_.notify_all();
  return id;
}

bool Writer::wait(uint64_t id, std::chrono::milliseconds timeout, std::string* error) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return finished_ >= id; })) return false;
  auto it = errors_.find(id);
  if (error != nullptr) *error = it == errors_.end() ? std::string() : it->second;
  return true;
}

void Writer::flush() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t last = submitted_;
  cv_.wait(lock, [&] { return finished_ >= last; });
}

void Writer::run() {
  for (;;) {
    std::pair<uint64_t, SaveJob> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, every job done
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    std::string error;
    // Fault injection for tests (tests/python/test_checkpoint_async.py): a slow disk,
    // so that training surely changes its tensors while their write is pending.
    if (const char* pause = std::getenv("SMP_CHECKPOINT_WRITER_PAUSE_MS")) {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(pause)));
    }
    try {
      SaveJob& j = job.second;
      write_sealed(j.tmp_path, j.records, j.manifest);
      if (j.publish) publish(j.tmp_path, j.final_path, j.keep_previous);
    } catch (const std::exception& e) {
      error = e.what();
      ::unlink(job.second.tmp_path.c_str());
    }
    job.second.records.clear();  // the staged buffers are the caller's again
    {
      std::lock_guard<std::mutex> lock(mu_);
      finished_ = job.first;
      if (!error.empty()) errors_[job.first] = std::move(error);
    }
    cv_.notify_all();
  }
}

Writer& background_writer() {
  static Writer* w = new Writer();  // never destroyed: flushed at exit by smp (atexit)
  return *w;
}

}  // namespace smp::checkpoint
