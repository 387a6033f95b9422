#include "smp_core/detail/shm_allreduce.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <fcntl.h>
#include <signal.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <fstream>
#include <random>
#include <thread>
#include <vector>

#include "smp_core/config.h"
#include "smp_core/grad_bucket.h"
#include "smp_core/errors.h"
#include "smp_core/runtime.h"

namespace smp::detail {

// Note [Shared-memory bucket reduction]
// When every rank of the dp group runs on this host, the reducer keeps each rank's
// bucket buffers in one shared segment (/dev/shm, unlinked once mapped, so nothing is
// left behind): rank r's buffers live in slot r. Autograd writes gradients into the
// slot as usual; a bucket is then summed by every rank at once: rank r adds up part r
// of all slots and writes the sum into part r of every slot. Two barriers per bucket
// ("inputs ready", "parts written") made of per-rank sequence words and a futex
// (waiters sleep: on a 2-core machine spinning would steal the peer's backward). Per
// rank that reads and writes each byte of the bucket about once, instead of Gloo's TCP
// loopback (two kernel copies per byte each way, plus a thread hand-off per message):
// about 5x less CPU for a 20 MiB bucket on 2 ranks. Operations are issued by the
// reducer's comm thread in queue order (Note [Ordered bucket communication]), so the
// sequence number of an operation is the same on every rank. Reusing a slot is safe:
// no rank passes the second barrier of an operation before every rank finished reading
// and writing it, and a rank's next write to its slot comes after that barrier.
// Only the default path uses it (no comm hook registered), plus the used-parameter
// bitmap; hooks get the buffers as ordinary tensors and reduce with the process group.

namespace {

constexpr uint64_t kMagic = 0x316d68732d706d73ULL;  // "smp-shm1"
constexpr size_t kLine = 64;                          // one word per cache line
constexpr size_t kPage = 4096;
enum Array { kInputs = 0, kParts = 1, kShadow = 2, kPid = 3, kArrays = 4 };

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

// Ranks may share a segment when they run on one kernel (boot id), one host name and
// one pid namespace (the liveness check below looks peers up by pid).
std::string host_identity(int rank) {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  char ns[128] = {0};
  ssize_t len = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  std::string id = std::string(host) + "|" + boot + "|" + (len > 0 ? std::string(ns, len) : "?");
  const int fake = env_int("SMP_FAKE_HOSTS", 0);  // tests: Note [Hosts of a group]
  if (rank < 0 && is_initialized()) rank = runtime().rank();
  if (fake > 0 && rank >= 0) id += str_cat("|fake host ", rank / fake);
  return id;
}

bool process_exited(int64_t id) {
  const auto pid = static_cast<pid_t>(id);
  if (pid <= 0 || pid == getpid()) return false;
  if (kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  auto close = line.rfind(')');  // "pid (comm) S ..."
  return close != std::string::npos && close + 2 < line.size() &&
         (line[close + 2] == 'Z' || line[close + 2] == 'X');
}

namespace {

void futex_wait(std::atomic<uint32_t>* addr, uint32_t expected, std::chrono::nanoseconds t) {
  timespec ts{static_cast<time_t>(t.count() / 1000000000), static_cast<long>(t.count() % 1000000000)};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

std::shared_ptr<ShmArena> ShmArena::create(const ProcessGroupPtr& pg, size_t slot_bytes,
                                           double timeout_s, const std::string& what,
                                           std::shared_ptr<const HostLinks> links) {
  const int world = pg->getSize(), rank = pg->getRank();
  if (world < 2) return nullptr;
  // Every rank decides from the same allgathered data: all or none use the segment.
  // Without links every rank must be on this host; links were made from the same
  // identities and flags (make_host_links), and say who is.
  if (!links) {
    const bool enabled = env_flag("SMP_REDUCER_SHM", true,
                                  "the ranks of one host sum buckets in shared memory; 0: "
                                  "through the process group");
    auto ids = allgather_bytes(pg, (enabled ? "1|" : "0|") + host_identity(), timeout_s,
                               what + " (host check)");
    for (const auto& id : ids)
      if (id != ids[0] || id[0] != '1') return nullptr;
  }

  // This host's ranks of the group, in group order; the first creates the segment.
  std::vector<int> members;
  for (int q = 0; q < world; ++q)
    if (!links || links->host_of.at(q) == links->host) members.push_back(q);
  std::shared_ptr<ShmArena> a(new ShmArena());
  a->links_ = std::move(links);
  a->world_ = static_cast<int>(members.size());
  a->rank_ = static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
  a->header_bytes_ = round_up(kLine * (1 + kArrays * static_cast<size_t>(a->world_)), kPage);
  a->slot_bytes_ = round_up(std::max<size_t>(slot_bytes, 1), kPage);
  a->bytes_ = a->header_bytes_ + a->slot_bytes_ * a->world_;

  std::string name;
  int fd = -1;
  if (a->world_ > 1 && a->rank_ == 0) {
    static std::atomic<uint64_t> counter{0};
    std::random_device rd;
    name = str_cat("/smp-reducer-", getpid(), "-", counter++, "-", rd());
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    // posix_fallocate reserves the pages now: a full /dev/shm fails here, not later
    // with SIGBUS in the middle of a step.
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(a->bytes_)) != 0 ||
        posix_fallocate(fd, 0, static_cast<off_t>(a->bytes_)) != 0) {
      if (fd >= 0) close(fd);
      shm_unlink(name.c_str());
      name.clear();
      fd = -1;
    }
  }
  // Each host's first rank names its segment (an empty name: it could not make one).
  auto names = allgather_bytes(pg, name, timeout_s, what + " (segment name)");
  name = names.at(members.front());
  if (a->world_ > 1 && !name.empty()) {
    if (a->rank_ != 0) fd = shm_open(name.c_str(), O_RDWR, 0600);
    if (fd >= 0) {
      void* p = mmap(nullptr, a->bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      close(fd);
      if (p != MAP_FAILED) a->base_ = static_cast<char*>(p);
    }
  }
  if (a->rank_ == 0 && a->base_) *reinterpret_cast<uint64_t*>(a->base_) = kMagic;
  if (a->base_) a->word(kPid, a->rank_)->store(static_cast<uint64_t>(getpid()));
  // Each rank's global rank travels along: errors name ranks as smprun prints them.
  const int global = is_initialized() ? runtime().rank() : rank;
  auto oks = allgather_bytes(pg, str_cat(a->base_ ? "1|" : "0|", global), timeout_s,
                             what + " (segment mapped)");
  if (a->rank_ == 0 && !name.empty()) shm_unlink(name.c_str());  // mapped (or given up)
  bool all_ok = true;
  for (const auto& ok : oks) all_ok = all_ok && ok.rfind("1|", 0) == 0;
  for (int q : members) a->global_.push_back(std::atoi(oks[q].c_str() + 2));
  if (all_ok) all_ok = *reinterpret_cast<uint64_t*>(a->base_) == kMagic;
  if (!all_ok) return nullptr;  // the destructor unmaps
  return a;
}

ShmArena::~ShmArena() {
  if (base_) munmap(base_, bytes_);
}

std::atomic<uint64_t>* ShmArena::word(int array, int r) const {
  return reinterpret_cast<std::atomic<uint64_t>*>(
      base_ + kLine * (1 + static_cast<size_t>(array) * world_ + r));
}

// The bell shares the magic's line; it only ever changes by fetch_add.
std::atomic<uint32_t>* ShmArena::bell() const {
  return reinterpret_cast<std::atomic<uint32_t>*>(base_ + 8);
}

char* ShmArena::slot(int r) const { return base_ + header_bytes_ + slot_bytes_ * r; }

at::Tensor ShmArena::slot_tensor(size_t offset, int64_t numel, at::ScalarType dtype) {
  SMP_CHECK(offset + numel * c10::elementSize(dtype) <= slot_bytes_, "ShmArena: region [",
            offset, ", +", numel, " x ", c10::toString(dtype), ") is outside the slot of ",
            slot_bytes_, " bytes");
  auto keep = shared_from_this();
  return at::from_blob(slot(rank_) + offset, {numel}, [keep](void*) {},
                       at::TensorOptions().dtype(dtype));
}

void ShmArena::post(int array, uint64_t op) {
  word(array, rank_)->store(op, std::memory_order_release);
  bell()->fetch_add(1, std::memory_order_acq_rel);
  futex_wake_all(bell());
}

void ShmArena::wait_all(int array, uint64_t op, double timeout_s, const std::string& what) {
  auto ready = [&] {
    for (int q = 0; q < world_; ++q)
      if (word(array, q)->load(std::memory_order_acquire) < op) return false;
    return true;
  };
  for (int i = 0; i < 64; ++i) {
    if (ready()) return;
    std::this_thread::yield();
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<
      std::chrono::steady_clock::duration>(std::chrono::duration<double>(timeout_s));
  while (true) {
    uint32_t seen = bell()->load(std::memory_order_acquire);
    if (ready()) return;
    // A peer process that exited never arrives: say so now rather than at the timeout.
    for (int q = 0; q < world_; ++q) {
      auto pid = static_cast<pid_t>(word(kPid, q)->load(std::memory_order_relaxed));
      if (word(array, q)->load(std::memory_order_acquire) < op && process_exited(pid))
        throw CommError(str_cat("smp: ", what, " failed: rank ", global_[q], " (pid ", pid,
                                ", rank ", q, " of the group) exited without reaching it "
                                "(shared-memory reduction, on rank ", global_[rank_], ")"));
    }
    auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      std::string missing;
      for (int q = 0; q < world_; ++q)
        if (word(array, q)->load(std::memory_order_acquire) < op)
          missing += str_cat(missing.empty() ? "" : ",", global_[q]);
      throw TimeoutError(str_cat("smp: timed out after ", timeout_s, " s waiting for ", what,
                                 ": rank(s) ", missing, " did not reach it (shared-memory "
                                 "reduction, on rank ", global_[rank_], ")"));
    }
    futex_wait(bell(), seen, std::min<std::chrono::nanoseconds>(deadline - now,
                                                                std::chrono::milliseconds(100)));
  }
}

size_t ShmArena::offset_of(const at::Tensor& t) const {
  const char* p = static_cast<const char*>(t.data_ptr());
  SMP_CHECK(p >= slot(rank_) && p < slot(rank_) + slot_bytes_,
            "ShmArena: the tensor is not in this rank's slot");
  return static_cast<size_t>(p - slot(rank_));
}

void ShmArena::allreduce(size_t offset, int64_t numel, at::ScalarType dtype, bool shadow,
                         double timeout_s, const std::string& what) {
  reduce(offset, {Segment{0, numel, -1}}, dtype, shadow, timeout_s, what, links_.get());
}

void ShmArena::reduce_segments(size_t offset, const std::vector<Segment>& segments,
                               at::ScalarType dtype, bool shadow, double timeout_s,
                               const std::string& what) {
  reduce(offset, segments, dtype, shadow, timeout_s, what, links_.get());
}

void ShmArena::allreduce_local(size_t offset, int64_t numel, at::ScalarType dtype, bool shadow,
                               double timeout_s, const std::string& what) {
  reduce(offset, {Segment{0, numel, -1}}, dtype, shadow, timeout_s, what, nullptr);
}

void ShmArena::broadcast_local(size_t offset, int64_t numel, at::ScalarType dtype, int root,
                               double timeout_s, const std::string& what) {
  const uint64_t op = ++op_;
  word(kShadow, rank_)->store(0, std::memory_order_release);
  post(kInputs, op);
  wait_all(kInputs, op, timeout_s, what);
  if (rank_ != root) {
    const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
    std::memcpy(slot(rank_) + offset, slot(root) + offset, bytes);
  }
  post(kParts, op);
  wait_all(kParts, op, timeout_s, what);
}

// Note [Two hosts swap]
// Between two hosts the sum of a part is one exchange: each side sends its host's sum
// whole and adds the other's, in kSwapChunks pieces sent and received at once, each
// added as soon as it is in (after its own send left, which reads the same memory).
// A two-rank allreduce moves the same bytes (half each way, twice) but in two phases,
// the second waiting on the first; measured on the namespace harness at 300 Mbit/s
// with 0.5 ms of delay, 8.4 MB a pair: 589 ms chunked allreduce, 454 ms swapped (median
// of 5). Both hosts add the same two numbers, and float addition commutes: the result is
// bitwise the same on both, (a + b) + (c + d) as before.
void ShmArena::swap_with_other_host(const HostLinks& links, at::Tensor& sum, double timeout_s,
                                    const std::string& what) {
  constexpr int64_t kSwapChunks = 8;
  const int other = 1 - links.host;
  // Bytes, viewed as the part's dtype: buckets and the used-parameter bitmap share it.
  const int64_t bytes = sum.numel() * static_cast<int64_t>(sum.element_size());
  if (!swap_in_.defined() || swap_in_.numel() < bytes)
    swap_in_ = at::empty({bytes}, sum.options().dtype(at::kByte));
  at::Tensor in = swap_in_.narrow(0, 0, bytes).view(sum.scalar_type());
  const int64_t n = std::min<int64_t>(kSwapChunks, std::max<int64_t>(1, sum.numel() / 1024));
  const std::vector<at::Tensor> mine = sum.chunk(n), theirs = in.chunk(n);
  std::vector<c10::intrusive_ptr<c10d::Work>> sends, recvs;
  for (size_t i = 0; i < mine.size(); ++i) {
    std::vector<at::Tensor> s{mine[i]}, r{theirs[i]};
    sends.push_back(links.cross->send(s, other, static_cast<int>(i)));
    recvs.push_back(links.cross->recv(r, other, static_cast<int>(i)));
  }
  const std::string label = str_cat(what, " (between hosts, from host ", other, ")");
  for (size_t i = 0; i < mine.size(); ++i) {
    wait_work(recvs[i], timeout_s, label);
    wait_work(sends[i], timeout_s, label);
    mine[i].add_(theirs[i]);
  }
}

// Note [Hierarchical reduction] (detail/host_links.cpp) for the between-hosts step.
void ShmArena::reduce(size_t offset, const std::vector<Segment>& segments, at::ScalarType dtype,
                      bool shadow, double timeout_s, const std::string& what,
                      const HostLinks* links) {
  const uint64_t op = ++op_;
  word(kShadow, rank_)->store(shadow ? op : 0, std::memory_order_release);
  post(kInputs, op);  // release: the shadow flag and the slot's data go with it
  wait_all(kInputs, op, timeout_s, what);

  std::vector<int> live;
  for (int q = 0; q < world_; ++q)
    if (word(kShadow, q)->load(std::memory_order_relaxed) != op) live.push_back(q);
  const bool me_live = word(kShadow, rank_)->load(std::memory_order_relaxed) != op;
  const int64_t esize = static_cast<int64_t>(c10::elementSize(dtype));
  auto part = [&](int q, int64_t begin, int64_t end) {
    return at::from_blob(slot(q) + offset + begin * esize, {end - begin},
                         at::TensorOptions().dtype(dtype));
  };
  // Sums [begin, end) of every live slot into `dst`'s (a shadow rank counts as zeros).
  auto sum_into = [&](int dst, int64_t begin, int64_t end) {
    at::Tensor sum = part(dst, begin, end);
    const bool dst_live = std::find(live.begin(), live.end(), dst) != live.end();
    bool first = !dst_live;
    for (int q : live) {
      if (q == dst) continue;
      if (first) {
        sum.copy_(part(q, begin, end));
        first = false;
      } else {
        sum.add_(part(q, begin, end));
      }
    }
    return sum;
  };
  // This rank's part of [seg.begin, seg.end): every rank sums one part, 64-byte aligned
  // so that parts share no cache line (the same parts on every host).
  auto my_part = [&](const Segment& seg) {
    const int64_t numel = seg.end - seg.begin;
    const int64_t align = std::max<int64_t>(1, kLine / esize);
    const int64_t chunk = (numel + world_ - 1) / world_;
    const int64_t per = (chunk + align - 1) / align * align;
    const int64_t begin = seg.begin + std::min(numel, per * rank_);
    return std::make_pair(begin, std::min(seg.end, begin + per));
  };
  const int dst = me_live || live.empty() ? rank_ : live[0];
  for (const Segment& seg : segments) {
    if (seg.begin >= seg.end) continue;
    if (links) {
      // This host's sum of my part, then the sum over hosts of it (to the owner's host
      // only for an owned segment), then copied where it is kept on this host.
      auto [begin, end] = my_part(seg);
      if (begin >= end) continue;
      at::Tensor sum = live.empty() ? part(rank_, begin, end).zero_() : sum_into(dst, begin, end);
      std::vector<at::Tensor> v{sum};
      if (seg.owner < 0) {
        if (links->hosts == 2) {
          swap_with_other_host(*links, sum, timeout_s, what);  // Note [Two hosts swap]
        } else {
          // In chunks (allreduce_flat), so Gloo's worker threads send and sum at once.
          wait_future(allreduce_flat(links->cross, sum), timeout_s, what + " (between hosts)");
        }
        for (int q : live)
          if (q != dst) part(q, begin, end).copy_(sum);
      } else {
        c10d::ReduceOptions o;
        o.rootRank = links->host_of.at(seg.owner);
        wait_work(links->cross->reduce(v, o), timeout_s, what + " (between hosts)");
        const int keeper = links->local_of.at(seg.owner);
        if (o.rootRank == links->host && keeper != dst) part(keeper, begin, end).copy_(sum);
      }
      continue;
    }
    if (live.empty()) continue;
    if (seg.owner == rank_) {
      sum_into(rank_, seg.begin, seg.end);
    } else if (seg.owner < 0) {
      auto [begin, end] = my_part(seg);
      if (begin >= end) continue;
      at::Tensor sum = sum_into(dst, begin, end);
      for (int q : live)
        if (q != dst) part(q, begin, end).copy_(sum);
    }
  }
  post(kParts, op);
  wait_all(kParts, op, timeout_s, what);
}

}  // namespace smp::detail
