// Shared-memory reduction for a process group whose ranks all run on this host: the
// reducer's default path. See Note [Shared-memory bucket reduction] in the .cpp.
// Included only from smp_core .cpp files.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "smp_core/comm.h"

namespace smp::detail {

// Elements [begin, end) of a bucket, and the group rank that keeps their sum: -1 for
// every rank (Note [Reduce to owner], detail/reducer_default_hooks.cpp).
struct Segment {
  int64_t begin = 0, end = 0;
  int owner = -1;
  bool operator==(const Segment& o) const {
    return begin == o.begin && end == o.end && owner == o.owner;
  }
};

// Host name, boot id and pid namespace: processes with equal identities can look each
// other up by pid (and share memory). SMP_FAKE_HOSTS=k (tests) adds "fake host
// RANK / k", so one machine's ranks count as hosts of k ranks each (Note [Hosts of a
// group], detail/host_links.cpp); `rank` is the runtime's rank when < 0 (before
// smp.init the caller names it).
std::string host_identity(int rank = -1);
// True if process `pid` of this host has exited (gone, or a zombie not reaped yet).
bool process_exited(int64_t pid);

// How a process group's ranks sit on hosts, and this rank's link between hosts for the
// hierarchical reduction (Note [Hierarchical reduction], detail/host_links.cpp).
struct HostLinks {
  int hosts = 1;              // hosts holding the group's ranks
  int per_host = 1;           // ranks of the group on each host (equal on every host)
  int host = 0;               // this rank's host (hosts ordered by their lowest rank)
  std::vector<int> host_of;   // group rank -> host
  std::vector<int> local_of;  // group rank -> index among its host's ranks
  // Local index j of every host, ordered by host (this rank is `host` in it): carries
  // part j of every bucket between hosts.
  ProcessGroupPtr cross;
  std::string shape;          // one line for the log
};

class ShmArena : public std::enable_shared_from_this<ShmArena> {
 public:
  // Collective over `pg` (two or three allgathers, from the calling thread):
  // every rank gets an arena with a slot of `slot_bytes` per rank, or every rank gets
  // null: world size 1, a rank on another host (hostname and boot id differ),
  // SMP_REDUCER_SHM=0 on any rank, or the segment could not be created (/dev/shm full).
  // With `links`: one arena per host, among the ranks the links put on this host (the
  // group spans hosts), and every sum of allreduce() and reduce_segments() goes on
  // between hosts over links->cross: still all or none.
  static std::shared_ptr<ShmArena> create(const ProcessGroupPtr& pg, size_t slot_bytes,
                                          double timeout_s, const std::string& what,
                                          std::shared_ptr<const HostLinks> links = nullptr);
  ~ShmArena();

  ShmArena(const ShmArena&) = delete;
  ShmArena& operator=(const ShmArena&) = delete;

  // A flat tensor over bytes [offset, offset + numel * itemsize) of this rank's slot;
  // it keeps the mapping alive.
  at::Tensor slot_tensor(size_t offset, int64_t numel, at::ScalarType dtype);

  // Sets that region of every rank's slot to the sum over ranks. A `shadow` rank counts
  // as zeros and its slot is left as it is. Every rank calls it in the same order (one
  // comm thread each); blocks until all ranks have finished; a rank that does not
  // arrive within `timeout_s` makes it throw TimeoutError naming `what` and the ranks.
  void allreduce(size_t offset, int64_t numel, at::ScalarType dtype, bool shadow,
                 double timeout_s, const std::string& what);
  // The same, by segment of the region (elements from `offset`): a segment with an
  // owner is summed into that rank's slot only (the other slots keep their own
  // values); one with owner -1 into every slot. One round: as costly as allreduce.
  void reduce_segments(size_t offset, const std::vector<Segment>& segments,
                       at::ScalarType dtype, bool shadow, double timeout_s,
                       const std::string& what);

  // Within this host only, whatever the links: every slot's region becomes the sum of
  // this host's slots (a shadow rank counts as zeros).
  void allreduce_local(size_t offset, int64_t numel, at::ScalarType dtype, bool shadow,
                       double timeout_s, const std::string& what);
  // Within this host: copies local rank `root`'s region into every other slot.
  void broadcast_local(size_t offset, int64_t numel, at::ScalarType dtype, int root,
                       double timeout_s, const std::string& what);
  // Bytes from the start of this rank's slot to `t`'s data (a tensor of slot_tensor()).
  size_t offset_of(const at::Tensor& t) const;

  int rank() const { return rank_; }  // on this host (the group rank when links are null)
  int world() const { return world_; }  // ranks on this host
  const std::shared_ptr<const HostLinks>& links() const { return links_; }

 private:
  ShmArena() = default;
  std::atomic<uint64_t>* word(int array, int r) const;
  std::atomic<uint32_t>* bell() const;
  char* slot(int r) const;
  void post(int array, uint64_t op);
  void wait_all(int array, uint64_t op, double timeout_s, const std::string& what);
  void reduce(size_t offset, const std::vector<Segment>& segments, at::ScalarType dtype,
              bool shadow, double timeout_s, const std::string& what, const HostLinks* links);
  void swap_with_other_host(const HostLinks& links, at::Tensor& sum, double timeout_s,
                            const std::string& what);

  char* base_ = nullptr;
  size_t bytes_ = 0;
  size_t header_bytes_ = 0;
  size_t slot_bytes_ = 0;
  int rank_ = 0;
  int world_ = 1;
  uint64_t op_ = 0;  // operations issued by this rank (the same sequence everywhere)
  std::vector<int> global_;  // local rank -> global rank (errors name global ranks)
  std::shared_ptr<const HostLinks> links_;
  at::Tensor swap_in_;  // Note [Two hosts swap]: what the other host sent (bytes), reused
};

}  // namespace smp::detail
