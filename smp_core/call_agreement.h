// CallAgreement: before an smp API collective (smp.barrier, smp.allgather,
// model.state_dict(), smp.save, ...), the members of the group check through the job's
// c10d store that each is about to make the same call, so a rank that made another call,
// is waiting in a call on another group, or has exited makes every waiting rank raise
// an error naming the calls, in seconds, instead of a hang until timeout_s or Gloo's
// "Connection closed by peer". See Note [Call agreement].
//
// Note [Call agreement]
// Each rank numbers its API collectives per group (#1, #2, ...; the group is named by
// its kind and its global ranks, "pp:0,1"). Before call #k on group G with name C it
//   1. sets its "current" key to (G, k, C)            (one store round trip),
//   2. adds 1 to the counter key (G, k, C)           (one round trip),
// and polls that counter until it reaches |G| (every member posted the same call). A
// member that posts another call adds to another counter, so the counter never fills;
// while it waits, the rank reads its members' current keys now and then and fails at
// once if a member
//   - posted a different call as its call #k on G (the calls differ),
//   - is waiting in a call on another group G' of which this rank is a member, and
//     that this rank has not made yet (each waits for the other: a deadlock), or
//   - has marked itself exited (mark_exited: an atexit handler, with the reason), or
//     runs on this host and its process is gone (killed before that handler ran).
// A member that has posted nothing new is merely slow: the wait goes on up to
// timeout_s, and the timeout names the call and the missing ranks. A member's current
// key can be stale (it finished an earlier call and computes): staleness is decidable
// for the groups this rank is in (that call needed this rank), and a stale key never
// raises. Before raising, the counter is read once more, so a member that arrived
// meanwhile is no error. The error text is built from the lowest-ranked side of the
// disagreement, and a rank that raises posts the text as its state (an exit does not
// replace it): a member still waiting for it raises that same text, so every rank of
// the disagreement raises one message even when one side has already exited.
// Cost per call: about three store round trips when the ranks arrive together; the
// counter of call #k-2 is deleted by the group's first rank (every member is past it).
// The training step's internal collectives (reducer, pipeline, join) do not take part.
//
// Threads: agree() may be called from any thread; calls on one group must come in the
// same order on every rank (as the collectives themselves must).
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "smp_core/comm.h"

namespace smp {

class CallAgreement {
 public:
  // `rank`: this process's global rank; `timeout_s` bounds every wait; keys live under
  // `prefix` in `store`.
  CallAgreement(StorePtr store, int rank, double timeout_s, std::string prefix = "smp/calls");

  // Returns once every member of the group `group` (kind name such as "pp", and its
  // global ranks in group order) has posted `call` as its next call on that group.
  // Throws CommError naming the calls and ranks when they cannot all make it, or
  // TimeoutError after timeout_s naming the ranks that did not arrive. A group of one
  // returns at once.
  void agree(const std::string& group, const std::vector<int>& members,
             const std::string& call);

  // Marks this rank as gone (`how`: "exited", or "failed (RuntimeError: ...)"); peers
  // waiting for it in agree() raise at once. Then, for up to `linger_s`, waits until
  // every peer has marked itself gone too, so that this process (which may host the
  // store) outlives the peers' last use of it: a peer already waiting reads the mark,
  // one that arrives at a call later still finds the store and the mark (not a reset
  // connection), and peers' own exit marks reach it.
  void mark_exited(const std::string& how, double linger_s);

  const StorePtr& store() const { return store_; }

 private:
  struct Posted;
  Posted read_current(int q);
  std::string describe(const Posted& p) const;
  bool waits_for_me(const Posted& p);
  template <typename E>
  [[noreturn]] void post_and_throw(const E& error);
  [[noreturn]] void fail(const std::string& gkey, const std::string& group,
                         const std::vector<int>& members, uint64_t seq,
                         const std::string& call, const std::vector<int>& problem);

  StorePtr store_;
  int rank_;
  double timeout_s_;
  std::string prefix_;
  std::string host_;  // detail::host_identity(): peers with the same one are checked by pid
  std::mutex mu_;
  std::atomic<bool> failed_{false};  // this rank raised an agreement error (posted as its state)
  std::map<std::string, uint64_t> seq_;                  // group key -> calls posted
  std::map<std::string, std::vector<std::string>> sent_;  // group key -> counter keys
};

// The process-wide CallAgreement of the runtime (made on first use, remade after a
// re-init with another store). Throws if smp is not initialized.
CallAgreement& call_agreement();
// Drops it and its store reference (at exit, while the store can still be destroyed
// in order, not by static destructors after the interpreter is gone).
void release_call_agreement();

}  // namespace smp
