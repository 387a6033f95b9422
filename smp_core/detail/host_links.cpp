// The hierarchical reduction of a dp group that spans hosts: which ranks share a host,
// the links between hosts, and the comm-hook adapter that runs a hook on the hosts'
// sums. Part of the reducer (detail/reducer_impl.h); the sums themselves are
// ShmArena's (detail/shm_allreduce.cpp).
#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <map>
#include <random>

#include "smp_core/config.h"
#include "smp_core/detail/reducer_impl.h"
#include "smp_core/errors.h"
#include "smp_core/runtime.h"

namespace smp::detail {

// Note [Hierarchical reduction]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A dp group whose ranks sit on several hosts, k ranks on each, reduces a bucket in
// three moves: the k ranks of a host sum it in their shared-memory arena, each summing
// part j of the bucket (the arena's own split, 64-byte aligned, the same on every
// host); local rank j then sums its part with local rank j of every other host over
// Gloo (k "cross" groups of one rank per host, so the k parts cross the network at
// once, each 1/k of the bucket); and writes the result into every slot of its host.
// Per bucket a host sends and receives about 2 x its size x (hosts - 1) / hosts, as a
// flat ring of hosts would, but each byte crosses once per host, not once per rank.
// Between two hosts the allreduce is a swap (Note [Two hosts swap], shm_allreduce.cpp).
// Owned segments (Note [Reduce to owner]) go to the owner's host with a reduce.
//
// The sum order per element is: this host's ranks (the summing rank's value, then the
// others by local rank), then the hosts in Gloo's order. The flat path sums all ranks
// in Gloo's ring order, so the two agree to float rounding (within 1e-6 relative for
// fp32 gradients), not bitwise; with two hosts of two ranks each, every element is
// (a + b) + (c + d) on every rank, run after run.
//
// A comm hook (Note [Hooks between hosts]) sees the host's mean: the hook's process
// group is the group of the hosts' first ranks, and what it compresses is what crosses
// hosts.
//
// The decision is collective (every rank decides from the same allgathered hosts) and
// made once per reducer: hierarchical when the group spans 2 or more hosts with the
// same number (2 or more) of its ranks on each, its parameters are on the CPU, and
// shared memory is allowed (ReducerOptions::shared_memory, SMP_REDUCER_SHM,
// SMP_REDUCER_HIERARCHY=0 turns it off); else flat Gloo as before.
//
// Note [Hosts of a group]
// A host is a host_identity(): host name, boot id and pid namespace. SMP_FAKE_HOSTS=k
// adds "rank / k" to it, so the ranks of one machine count as hosts of k ranks (tests
// of the arithmetic without namespaces; the links then run over loopback).

std::shared_ptr<const HostLinks> make_host_links(const ProcessGroupPtr& pg, bool allowed,
                                                 double timeout_s, const std::string& what) {
  const int world = pg->getSize(), rank = pg->getRank();
  if (world < 2) return nullptr;
  const bool enabled =
      allowed && is_initialized() &&
      env_flag("SMP_REDUCER_HIERARCHY", true,
               "a dp group across hosts sums in shared memory within each host, then "
               "between hosts over Gloo; 0: flat over the process group") &&
      env_flag("SMP_REDUCER_SHM", true,
               "the ranks of one host sum buckets in shared memory; 0: through the "
               "process group");
  const int global = is_initialized() ? runtime().rank() : rank;
  auto ids = allgather_bytes(pg, str_cat(enabled ? "1" : "0", "|", global, "|", host_identity()),
                             timeout_s, what + " (hosts)");
  auto links = std::make_shared<HostLinks>();
  std::map<std::string, int> host_index;
  std::vector<int> globals, count;
  bool all_enabled = true;
  for (const auto& id : ids) {
    all_enabled = all_enabled && id[0] == '1';
    const size_t bar = id.find('|', 2);
    globals.push_back(std::atoi(id.c_str() + 2));
    auto [it, fresh] = host_index.emplace(id.substr(bar + 1), static_cast<int>(host_index.size()));
    if (fresh) count.push_back(0);
    links->host_of.push_back(it->second);
    links->local_of.push_back(count[it->second]++);
  }
  links->hosts = static_cast<int>(count.size());
  links->per_host = count[0];
  links->host = links->host_of[rank];
  bool even = true;
  for (int c : count) even = even && c == count[0];
  if (!all_enabled || links->hosts < 2 || !even || links->per_host < 2) return nullptr;

  // Cross group j: local rank j of every host, by host. Rank 0 names this reducer's
  // groups (unique in the job: a reducer may be rebuilt or made again).
  std::string token;
  if (rank == 0) token = str_cat(std::random_device{}(), "-", std::random_device{}());
  token = broadcast_bytes(pg, token, 0, timeout_s, what + " (links between hosts)");
  const int j = links->local_of[rank];
  std::vector<int> members(links->hosts, -1);
  for (int q = 0; q < world; ++q)
    if (links->local_of[q] == j) members[links->host_of[q]] = globals[q];
  links->cross = runtime().make_group(str_cat("xhost/", token, "/", j), members);
  SMP_CHECK(links->cross, "the cross-host group of local rank ", j, " has no place for rank ",
            global);
  links->shape = str_cat(what, " spans ", links->hosts, " hosts x ", links->per_host,
                         " ranks: buckets sum in shared memory within a host, then between "
                         "hosts over Gloo, each rank of a host carrying 1/", links->per_host,
                         " of every bucket (hierarchical reduction)");
  return links;
}

namespace {

// Note [Hooks between hosts]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// With the hierarchical reduction a registered comm hook runs on the first rank of
// each host only, over the group of those ranks (the hosts group; the hook's state is
// given it at registration, python/smp/ddp_comm_hooks/__init__.py). Its bucket holds
// the host's mean (the sum over the host's ranks divided by their count), so a hook
// that averages over its group (allreduce, fp16_compress, PowerSGD) averages over
// every rank of the dp group, as it did flat; PowerSGD compresses only what crosses
// hosts and keeps one error-feedback state per host. The result goes to the host's
// other ranks through the arena. run() waits for the hook, so buckets go one at a time.
class HostsHook : public CommHook {
 public:
  HostsHook(CommHookPtr inner, std::shared_ptr<ShmArena> arena, double timeout_s,
            std::string group, std::shared_ptr<std::atomic<int64_t>> steps)
      : inner_(std::move(inner)), arena_(std::move(arena)), timeout_s_(timeout_s),
        group_(std::move(group)), steps_(std::move(steps)) {}

  FuturePtr run(GradBucket& bucket) override {
    const at::Tensor& buf = bucket.buffer();
    const size_t offset = arena_->offset_of(buf);
    const std::string what = str_cat("bucket ", bucket.index(), " of ", bucket.bucket_count(),
                                     " (", name(), ") on ", group_, " in step ",
                                     steps_->load() + 1);
    arena_->allreduce_local(offset, buf.numel(), buf.scalar_type(), bucket.is_shadow(),
                            timeout_s_, what + " (within the host)");
    if (arena_->rank() == 0) {
      at::NoGradGuard no_grad;
      buf.div_(arena_->world());
      GradBucket hosts(bucket.index(), bucket.bucket_count(), buf, bucket.parameters(),
                       bucket.offsets(), arena_->links()->cross, bucket.is_shadow());
      FuturePtr fut = inner_->run(hosts);
      SMP_CHECK(fut, "comm hook '", inner_->name(), "' returned no future");
      wait_future(fut, timeout_s_, what + " (between hosts)");
      at::Tensor out = inner_->result(hosts, fut->value());
      SMP_CHECK(out.numel() == buf.numel(), "comm hook '", inner_->name(), "' returned ",
                out.numel(), " elements for a bucket of ", buf.numel());
      if (!out.is_same(buf)) buf.copy_(out.reshape({-1}));
    }
    arena_->broadcast_local(offset, buf.numel(), buf.scalar_type(), 0, timeout_s_,
                            what + " (the result within the host)");
    return completed_future(buf);
  }
  std::string name() const override { return inner_->name() + " between hosts"; }
  bool issues_all_in_run() const override { return true; }

 private:
  CommHookPtr inner_;
  std::shared_ptr<ShmArena> arena_;
  double timeout_s_;
  std::string group_;
  std::shared_ptr<std::atomic<int64_t>> steps_;
};

}  // namespace

CommHookPtr make_hosts_hook(CommHookPtr inner, std::shared_ptr<ShmArena> arena, double timeout_s,
                            std::string group, std::shared_ptr<std::atomic<int64_t>> steps) {
  return std::make_shared<HostsHook>(std::move(inner), std::move(arena), timeout_s,
                                     std::move(group), std::move(steps));
}

}  // namespace smp::detail
