// Byte-level collectives and buffered point-to-point messages used by the object
// collectives (smp.barrier/broadcast/send/recv_from/allgather/gather) and by init.
//
// Collectives run on a c10d ProcessGroup; callers on every rank must issue them in
// the same order (DESIGN.md invariant). Point-to-point messages go through the job's
// c10d Store as numbered keys per (src, dst) pair, so a send never blocks (a ring in
// which every rank sends before it receives works) and messages between two ranks
// arrive in the order they were sent.
// Every wait is bounded by `timeout_s`; a timeout throws TimeoutError naming what
// was awaited and from which rank.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <c10/util/intrusive_ptr.h>

namespace c10d {
class ProcessGroup;
class Store;
class Work;
}  // namespace c10d

namespace smp {

using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
using StorePtr = c10::intrusive_ptr<c10d::Store>;

// Waits for `work`; on failure or timeout throws CommError/TimeoutError naming `what`.
// Note [Peers by address] (comm.cpp): `msg` with the host and ranks of each peer
// address it names ("[10.0.0.2]:port"), where smp.init learned them; else `msg`.
std::string with_peer_names(const std::string& msg);
// Where each rank's address is (address -> "ranks 2-3 on host 'h1'"); smp.init.
void set_peer_names(std::vector<std::pair<std::string, std::string>> by_address);

void wait_work(const c10::intrusive_ptr<c10d::Work>& work, double timeout_s,
               const std::string& what);

// Every member contributes `data`; returns all contributions in group-rank order.
std::vector<std::string> allgather_bytes(const ProcessGroupPtr& pg, const std::string& data,
                                         double timeout_s, const std::string& what);

// Returns `data` of group rank `root` on every member.
std::string broadcast_bytes(const ProcessGroupPtr& pg, const std::string& data, int root,
                            double timeout_s, const std::string& what);

void barrier(const ProcessGroupPtr& pg, double timeout_s, const std::string& what);

// Note [Job secret] (smp_common/auth.h): every value smp puts in the store is sealed with
// the job key, and read back only when its MAC verifies. store_get_sealed throws
// CommError naming the key when it does not (nothing of the value is decoded).
void store_set_sealed(const StorePtr& store, const std::string& key, const std::string& value);
std::string store_get_sealed(const StorePtr& store, const std::string& key);

// Sets this process's job key (Note [Job secret]), collectively over `store` before
// any process group exists: SMP_JOB_SECRET (or SMP_JOB_SECRET_FILE) when set, else a
// key rank 0 draws and publishes in the store. The first store_exchange after it (the
// config's, in agree_config) is where every rank proves the key to every other: a
// secret that differs between nodes fails there, on every rank, naming who differs,
// before any collective. Returns true when the key came from the environment. Throws
// ConfigError for a malformed secret.
bool establish_job_key(const StorePtr& store, int rank, int world_size, double timeout_s);

// Note [Failed peer] (reducer.cpp): a rank posts why it will not reach its group's
// reduction of `step` (sealed, key prefix/<rank>/<step>); a waiting peer reads the
// first such post of `peers` for the step it waits in, "" when there is none.
void post_failure(const StorePtr& store, const std::string& prefix, int rank, int64_t step,
                  const std::string& why);
std::string posted_failure(const StorePtr& store, const std::string& prefix,
                           const std::vector<int>& peers, int64_t step);

// Store-based all-to-all exchange used before any process group exists: rank posts
// `value` under `key`/<rank> (sealed) and reads every rank's. On timeout the error
// names the ranks that never posted; a value that fails authentication, the ranks
// whose value it was.
std::vector<std::string> store_exchange(const StorePtr& store, const std::string& key, int rank,
                                        int world_size, const std::string& value,
                                        double timeout_s, const std::string& what);

// Buffered, ordered point-to-point byte messages between global ranks over a Store.
// Thread-safe. Each message key is deleted by its receiver.
class StoreMailbox {
 public:
  StoreMailbox(StorePtr store, int rank, double timeout_s, std::string prefix = "smp/p2p");
  ~StoreMailbox();

  void send(int dst, const std::string& bytes);
  // Blocks until the next message from `src` arrives (or timeout).
  std::string recv(int src);

  int rank() const { return rank_; }

 private:
  StorePtr store_;
  int rank_;
  double timeout_s_;
  std::string prefix_;
  std::mutex mu_;
  std::map<int, uint64_t> send_seq_, recv_seq_;
};

}  // namespace smp
