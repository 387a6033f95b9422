#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>
#include <xxh_x86dispatch.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <sstream>

#include "checkpoint/detail/hash.h"
#include "checkpoint/detail/trailer.h"
#include "checkpoint/detail/zip_index.h"
#include "smp_core/errors.h"

namespace smp::checkpoint {
namespace {

using namespace detail;  // the trailer and file helpers (detail/trailer.h)

constexpr size_t kChunk = 1 << 20;      // read, then hashed while still in cache

std::string dir_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void fsync_dir(const std::string& path) {
  Fd d(::open(dir_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.fd < 0) throw CheckpointError(sys_error("cannot open directory", dir_of(path)));
  if (::fsync(d.fd) != 0) throw CheckpointError(sys_error("fsync of directory failed", dir_of(path)));
}

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}


}  // namespace

void seal(const std::string& tmp_path, Manifest& m) {
  Fd f(::open(tmp_path.c_str(), O_RDWR | O_CLOEXEC));
  if (f.fd < 0) throw CheckpointError(sys_error("cannot open", tmp_path));
  struct stat st;
  if (::fstat(f.fd, &st) != 0) throw CheckpointError(sys_error("stat failed", tmp_path));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kEocd) throw CheckpointError(str_cat("smp: checkpoint '", tmp_path, "': not a zip"));
  unsigned char eocd[kEocd];
  pread_all(f.fd, eocd, kEocd, size - kEocd, tmp_path);
  if (!(eocd[0] == 'P' && eocd[1] == 'K' && eocd[2] == 5 && eocd[3] == 6 && eocd[20] == 0 &&
        eocd[21] == 0)) {
    throw CheckpointError(str_cat("smp: checkpoint '", tmp_path,
                                  "': torch.save did not end with a comment-less zip end record"));
  }
  // Hash what torch wrote, through a read-only mapping of the pages it just wrote.
  Hasher h;
  const uint64_t hashed = size - 2;
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED | MAP_POPULATE, f.fd, 0);
  if (map == MAP_FAILED) throw CheckpointError(sys_error("mmap failed", tmp_path));
  h.update(map, hashed);
  ::munmap(map, size);
  // A zip someone else wrote carries no entry table: the version 1 layout.
  m.format_version = 1;
  m.entries_offset = m.entries_size = m.entries_hash = m.entry_chunk = 0;
  m.payload_size = size;
  m.payload_hash = h.digest();
  append_trailer(f.fd, size, m, tmp_path);
  if (::fsync(f.fd) != 0) throw CheckpointError(sys_error("fsync failed", tmp_path));
}

// Note [Generations]: a partial save is one file per pp rank, renamed by different
// processes, so no single rename commits it. Each rank first seals its temporary
// (fsync), the ranks meet at a barrier, and each then hard-links its current file to
// `f_p.prev` before renaming the new one over `f_p`; after a second barrier `.prev`
// goes. A save killed between two ranks' renames leaves every part's old generation
// at `f_p` or `f_p.prev`, and readers pick the newest save id present for every part.
void publish(const std::string& tmp_path, const std::string& final_path, bool keep_previous) {
  if (keep_previous && exists(final_path)) {
    const std::string prev = final_path + ".prev";
    const std::string prev_tmp = str_cat(prev, ".tmp-", ::getpid());
    ::unlink(prev_tmp.c_str());
    if (::link(final_path.c_str(), prev_tmp.c_str()) != 0) {
      throw CheckpointError(sys_error("cannot link the previous generation", final_path));
    }
    if (::rename(prev_tmp.c_str(), prev.c_str()) != 0) {
      throw CheckpointError(sys_error("cannot keep the previous generation", prev));
    }
  }
  if (::rename(tmp_path.c_str(), final_path.c_str()) != 0) {
    throw CheckpointError(sys_error(str_cat("cannot rename '", tmp_path, "' onto it"), final_path));
  }
  fsync_dir(final_path);
}

void drop_previous(const std::string& final_path) {
  // Not made durable: a `.prev` that survives a crash only offers an older whole
  // generation, and readers take the newest (one directory fsync saved per part).
  // Note [Freeing the previous generation]: unlinking the last link of a large file
  // frees its blocks (measured ~35 ms for 96 MB here) and the save need not wait for
  // that: `.prev` is renamed away at once (so the next save may create it again and
  // readers never see it) and a detached thread unlinks the renamed file. A process
  // that exits first leaves that `.trash-*` file behind; no reader looks at it.
  const std::string prev = final_path + ".prev";
  std::random_device rd;
  const std::string trash = str_cat(final_path, ".trash-", ::getpid(), "-", rd());
  if (::rename(prev.c_str(), trash.c_str()) != 0) return;  // no previous generation
  std::thread([trash] { ::unlink(trash.c_str()); }).detach();
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  std::random_device rd;
  const std::string tmp = str_cat(path, ".tmp-", ::getpid(), "-", rd());
  {
    Fd f(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (f.fd < 0) throw CheckpointError(sys_error("cannot create", tmp));
    pwrite_all(f.fd, bytes.data(), bytes.size(), 0, tmp);
    if (::fsync(f.fd) != 0) throw CheckpointError(sys_error("fsync failed", tmp));
  }
  publish(tmp, path, false);
}

Manifest read_manifest(const std::string& path) {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) throw CheckpointError(sys_error("cannot open", path));
  uint64_t size = 0;
  return read_trailer(f.fd, path, &size);
}

bool has_manifest(const std::string& path) {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) return false;
  struct stat st;
  if (::fstat(f.fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < kFooter) return false;
  char tail[8];
  try {
    pread_all(f.fd, tail, 8, static_cast<uint64_t>(st.st_size) - 8, path);
  } catch (const CheckpointError&) {
    return false;
  }
  return std::memcmp(tail, kMagic, 8) == 0;
}

namespace {

// Reads a sealed file's payload once, in order, hashing every byte but the zip comment
// length (the last 2 bytes of the payload) as it goes; `check()` compares the hash
// with the manifest's. Shared by read_verified (records into tensors) and verify.
class HashedReader {
 public:
  HashedReader(const std::string& path, const Manifest& m, int fd)
      : path_(path), m_(m), fd_(fd), hashed_(m.payload_size - 2), scratch_(kChunk) {}

  // Reads [off, off + n) into dst (off must be where the last read ended).
  void read(char* dst, uint64_t off, uint64_t n) {
    for (uint64_t done = 0; done < n;) {
      const size_t k = static_cast<size_t>(std::min<uint64_t>(kChunk, n - done));
      pread_all(fd_, dst + done, k, off + done, path_);
      const uint64_t lo = off + done;
      if (lo < hashed_) h_.update(dst + done, static_cast<size_t>(std::min<uint64_t>(k, hashed_ - lo)));
      done += k;
    }
    pos_ = off + n;
  }

  // Reads (and hashes) what lies between the last read and `end`, keeping none of it.
  void skip_to(uint64_t end) {
    while (pos_ < end) read(scratch_.data(), pos_, std::min<uint64_t>(kChunk, end - pos_));
  }

  void check() {
    skip_to(m_.payload_size);
    if (h_.digest() != m_.payload_hash)
      throw CheckpointError(str_cat("smp: checkpoint '", path_, "': checksum mismatch (file "
                                    "altered; ", m_.describe(), ")"));
  }

 private:
  const std::string& path_;
  const Manifest& m_;
  int fd_;
  uint64_t hashed_;
  uint64_t pos_ = 0;
  Hasher h_;
  std::vector<char> scratch_;
};

}  // namespace

VerifiedFile read_verified(const std::string& path) {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) throw CheckpointError(sys_error("cannot open", path));
  uint64_t size = 0;
  VerifiedFile out;
  out.manifest = read_trailer(f.fd, path, &size);
  auto index = detail::read_zip_index(f.fd, out.manifest.payload_size - kEocd, path);
  // One sequential pass: each record straight into its own tensor, the bytes between
  // records into a scratch buffer; every byte hashed right after it is read.
  HashedReader reader(path, out.manifest, f.fd);
  out.records.reserve(index.size());
  for (auto& rec : index) {
    reader.skip_to(rec.offset);
    at::Tensor t = at::empty({static_cast<int64_t>(rec.size)}, at::kByte);
    reader.read(static_cast<char*>(t.data_ptr()), rec.offset, rec.size);
    out.records.push_back({std::move(rec.name), std::move(t)});
  }
  reader.check();
  return out;
}

Manifest verify(const std::string& path) {
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (f.fd < 0) throw CheckpointError(sys_error("cannot open", path));
  uint64_t size = 0;
  Manifest m = read_trailer(f.fd, path, &size);
  HashedReader(path, m, f.fd).check();
  return m;
}

std::vector<std::string> choose_generation(const std::string& base,
                                           const std::vector<std::vector<Candidate>>& by_part) {
  // Generations proposed by part 0's files, newest first.
  std::vector<Manifest> gens;
  if (!by_part.empty()) {
    for (const auto& c : by_part[0]) {
      if (c.ok && c.manifest.partial && c.manifest.part == 0) gens.push_back(c.manifest);
    }
  }
  std::sort(gens.begin(), gens.end(), [](const Manifest& a, const Manifest& b) {
    return a.save_time_ns > b.save_time_ns;
  });
  for (const auto& g : gens) {
    std::vector<std::string> paths;
    for (int p = 0; p < g.parts; ++p) {
      if (p >= static_cast<int>(by_part.size())) break;
      for (const auto& c : by_part[p]) {
        if (c.ok && c.manifest.save_id == g.save_id && c.manifest.part == p &&
            c.manifest.parts == g.parts) {
          paths.push_back(c.path);
          break;
        }
      }
      if (static_cast<int>(paths.size()) != p + 1) break;
    }
    if (static_cast<int>(paths.size()) == g.parts) return paths;
  }
  // Nothing whole: say what each file holds.
  std::ostringstream os;
  os << "smp: partial checkpoint '" << base << "' has no complete save:";
  if (gens.empty()) os << " part 0 ('" << base << "_0') is missing or unreadable;";
  const int want = gens.empty() ? static_cast<int>(by_part.size()) : gens.front().parts;
  for (int p = 0; p < std::max<int>(want, static_cast<int>(by_part.size())); ++p) {
    if (p >= static_cast<int>(by_part.size()) || by_part[p].empty()) {
      os << " '" << base << "_" << p << "' missing;";
      continue;
    }
    for (const auto& c : by_part[p]) {
      os << " '" << c.path << "': " << (c.ok ? c.manifest.describe() : c.error) << ";";
    }
  }
  if (!gens.empty()) {
    os << " (parts from different saves, or a missing part: newest save 0x" << std::hex
       << gens.front().save_id << std::dec << " needs " << gens.front().parts << " parts)";
  }
  throw CheckpointError(os.str());
}

std::pair<std::vector<std::string>, Manifest> resolve_partial(const std::string& base) {
  std::vector<std::vector<Candidate>> by_part;
  for (int p = 0;; ++p) {
    std::vector<Candidate> cands;
    for (const std::string& path : {str_cat(base, "_", p), str_cat(base, "_", p, ".prev")}) {
      if (!exists(path)) continue;
      Candidate c;
      c.path = path;
      try {
        c.manifest = read_manifest(path);
        c.ok = true;
      } catch (const CheckpointError& e) {
        c.error = e.what();
      }
      cands.push_back(std::move(c));
    }
    if (cands.empty()) {
      // A missing part in the middle still ends the listing; choose_generation names it.
      bool later = exists(str_cat(base, "_", p + 1)) || exists(str_cat(base, "_", p + 1, ".prev"));
      if (!later) break;
    }
    by_part.push_back(std::move(cands));
  }
  auto paths = choose_generation(base, by_part);
  return {paths, read_manifest(paths[0])};
}

}  // namespace smp::checkpoint
