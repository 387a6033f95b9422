#include "checkpoint/mapped.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <ATen/ATen.h>

#include <algorithm>

#include "checkpoint/checkpoint_error.h"
#include "checkpoint/detail/hash.h"
#include "checkpoint/detail/trailer.h"
#include "smp_core/errors.h"

namespace smp::checkpoint {
namespace {

std::atomic<uint64_t> g_bytes_read{0};

}  // namespace

// Note [Reads by entry]
// ~~~~~~~~~~~~~~~~~~~~~
// A resharding load keeps only some of what a part holds (at pp 1 -> 2 each rank half
// of the one part), and a same-layout load copies every tensor into a parameter that
// already exists. Reading the whole part, verifying it, unpickling it and then copying
// reads and touches every byte twice. Here:
//   - the trailer, the entry table (checked against the manifest's hash) and the small
//     records (the pickle) are read and verified first;
//   - the file is mapped (MAP_PRIVATE: a stray write stays in this process), and each
//     storage record becomes a tensor over its mapped bytes, so unpickling touches none
//     of them;
//   - the caller verifies the records it keeps (each chunk against the table, pages
//     read from disk once, sequentially: MADV_SEQUENTIAL + WILLNEED) and copies them
//     into the parameters and the optimizer's state (that copy is the only one).
// Records nobody keeps are never read. A verification failure is raised before the
// record is used, naming the file and the record.
MappedFile::MappedFile(const std::string& path) : path_(path) {
  detail::Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) throw CheckpointError(detail::sys_error("cannot open", path));
  manifest_ = detail::read_trailer(f.fd, path, &size_);
  if (manifest_.entry_chunk == 0) {
    throw CheckpointError(str_cat("smp: checkpoint '", path, "': format version ",
                                  manifest_.format_version, " has no entry table"));
  }
  std::string table(static_cast<size_t>(manifest_.entries_size), '\0');
  if (manifest_.entries_offset > manifest_.payload_size ||
      manifest_.entries_size > manifest_.payload_size - manifest_.entries_offset) {
    throw CheckpointError(str_cat("smp: checkpoint '", path, "': entry table outside the file"));
  }
  detail::pread_all(f.fd, table.data(), table.size(), manifest_.entries_offset, path);
  g_bytes_read += table.size() + (size_ - manifest_.payload_size);
  if (detail::hash_of(table.data(), table.size()) != manifest_.entries_hash) {
    throw CheckpointError(str_cat("smp: checkpoint '", path,
                                  "': checksum mismatch in its entry table (file altered; ",
                                  manifest_.describe(), ")"));
  }
  entries_ = decode_entries(table, manifest_.entry_chunk, manifest_.payload_size, path);
  for (size_t i = 0; i < entries_.size(); ++i) index_[entries_[i].name] = i;
  verified_.assign(entries_.size(), false);
  void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, f.fd, 0);
  if (p == MAP_FAILED) throw CheckpointError(detail::sys_error("mmap failed", path));
  const uint64_t n = size_;
  map_ = std::shared_ptr<void>(p, [n](void* q) { ::munmap(q, n); });
}

MappedFile::~MappedFile() = default;

const Entry& MappedFile::entry(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    throw CheckpointError(str_cat("smp: checkpoint '", path_, "': no record '", name, "'"));
  }
  return entries_[it->second];
}

at::Tensor MappedFile::record(const std::string& name) const {
  const Entry& e = entry(name);
  char* base = static_cast<char*>(map_.get()) + e.offset;
  std::shared_ptr<void> keep = map_;
  return at::from_blob(base, {static_cast<int64_t>(e.size)}, [keep](void*) {},
                       at::TensorOptions().dtype(at::kByte));
}

void MappedFile::verify(const std::string& name) {
  const size_t i = index_.count(name) ? index_.at(name) : entries_.size();
  const Entry& e = entry(name);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (verified_[i]) return;
  }
  const char* base = static_cast<const char*>(map_.get()) + e.offset;
  if (e.size > 0) {
    // Whole pages around the record: the kernel reads it ahead in large requests.
    const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    const uintptr_t lo = reinterpret_cast<uintptr_t>(base) & ~(page - 1);
    const size_t len = static_cast<size_t>(reinterpret_cast<uintptr_t>(base) + e.size - lo);
    ::madvise(reinterpret_cast<void*>(lo), len, MADV_SEQUENTIAL);
    ::madvise(reinterpret_cast<void*>(lo), len, MADV_WILLNEED);
  }
  const uint64_t chunk = manifest_.entry_chunk;
  for (size_t c = 0; c < e.chunk_hashes.size(); ++c) {
    const uint64_t off = c * chunk;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk, e.size - off));
    if (detail::hash_of(base + off, n) != e.chunk_hashes[c]) {
      throw CheckpointError(str_cat("smp: checkpoint '", path_, "': checksum mismatch in record '",
                                    name, "' (bytes ", e.offset + off, "..", e.offset + off + n,
                                    "; file altered; ", manifest_.describe(), ")"));
    }
  }
  g_bytes_read += e.size;
  std::lock_guard<std::mutex> lock(mu_);
  verified_[i] = true;
}

at::Tensor MappedFile::verified(const std::string& name) {
  verify(name);
  return record(name);
}

uint64_t MappedFile::bytes_read() { return g_bytes_read.load(); }

}  // namespace smp::checkpoint
