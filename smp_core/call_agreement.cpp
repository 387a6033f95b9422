#include "smp_core/call_agreement.h"

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <algorithm>
#include <chrono>
#include <memory>
#include <set>
#include <sstream>
#include <thread>

#include "smp_core/detail/shm_allreduce.h"
#include "smp_core/errors.h"
#include "smp_core/runtime.h"

#include <unistd.h>

namespace smp {
namespace {

using Clock = std::chrono::steady_clock;

std::string csv(const std::vector<int>& v, const char* sep = ",") {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += str_cat(i ? sep : "", v[i]);
  return s;
}

std::string list(const std::vector<int>& v) { return "[" + csv(v, ", ") + "]"; }

std::vector<int> parse_csv(const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) out.push_back(std::stoi(item));
  return out;
}

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

bool contains(const std::vector<int>& v, int x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

}  // namespace

// What a rank's "current" key says: nothing yet, gone, its latest call, or the error
// it raised in its latest call.
struct CallAgreement::Posted {
  enum Kind { kNone, kExited, kCall, kError } kind = kNone;
  std::string how;               // kExited: "exited", "failed (...)"; kError: the message
  std::string group;             // kCall: "pp"
  std::vector<int> members;      // kCall: global ranks in group order
  uint64_t seq = 0;              // kCall: the call's number on its group
  std::string call;              // kCall: "model.state_dict()"
  std::string host;              // kCall: detail::host_identity() of the poster
  int64_t pid = 0;               // kCall: its process id
  std::string key() const { return group + ":" + csv(members); }
  bool same_call(const std::string& gkey, uint64_t s, const std::string& c) const {
    return kind == kCall && key() == gkey && seq == s && call == c;
  }
  static Posted of_call(const std::string& group, const std::vector<int>& members,
                        uint64_t seq, const std::string& call, const std::string& host) {
    Posted p;
    p.kind = kCall;
    p.group = group;
    p.members = members;
    p.seq = seq;
    p.call = call;
    p.host = host;
    p.pid = getpid();
    return p;
  }
  std::string encode() const {
    if (kind == kExited) return "x\n" + how;
    if (kind == kError) return "e\n" + how;
    return str_cat("c\n", group, "\n", csv(members), "\n", seq, "\n", call, "\n", host, "\n",
                   pid);
  }
  static Posted decode(const std::string& s) {
    Posted p;
    std::vector<std::string> f;
    std::stringstream in(s);
    std::string line;
    while (std::getline(in, line)) f.push_back(line);
    if (f.size() >= 2 && (f[0] == "x" || f[0] == "e")) {
      p.kind = f[0] == "x" ? kExited : kError;
      p.how = f[1];
    } else if (f.size() >= 7 && f[0] == "c") {
      p.kind = kCall;
      p.group = f[1];
      p.members = parse_csv(f[2]);
      p.seq = std::stoull(f[3]);
      p.call = f[4];
      p.host = f[5];
      p.pid = std::stoll(f[6]);
    }
    return p;
  }
};

CallAgreement::CallAgreement(StorePtr store, int rank, double timeout_s, std::string prefix)
    : store_(std::move(store)),
      rank_(rank),
      timeout_s_(timeout_s),
      prefix_(std::move(prefix)),
      host_(detail::host_identity()) {
  SMP_CHECK(store_, "CallAgreement: store is null");
}

CallAgreement::Posted CallAgreement::read_current(int q) {
  std::string key = str_cat(prefix_, "/cur/", q);
  if (!store_->check({key})) return Posted{};  // get() would block until it exists
  Posted p = Posted::decode(store_get_sealed(store_, key));
  // A rank killed before its exit handler ran left its last call posted: on this host
  // its pid tells.
  if (p.kind == Posted::kCall && p.host == host_ && detail::process_exited(p.pid)) {
    p.kind = Posted::kExited;
    p.how = str_cat("died (pid ", p.pid, " is gone)");
  }
  return p;
}

// `p` waits in a call on a group of this rank that this rank has not made yet: it
// cannot finish before this rank makes it (a posting this rank is past is stale).
bool CallAgreement::waits_for_me(const Posted& p) {
  if (p.kind != Posted::kCall || !contains(p.members, rank_)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = seq_.find(p.key());
  return (it == seq_.end() ? 0 : it->second) < p.seq;
}

std::string CallAgreement::describe(const Posted& p) const {
  if (p.kind == Posted::kExited)
    return p.how == "exited" ? "exited without making that call"
                             : str_cat(p.how, " without making that call");
  if (p.kind == Posted::kNone) return "has made no smp collective call";
  if (p.kind == Posted::kError) return "raised: " + p.how;
  return str_cat("called ", p.call, " (its call #", p.seq, " on the ", p.group, " group ",
                 list(p.members), ")");
}

void CallAgreement::fail(const std::string& gkey, const std::string& group,
                         const std::vector<int>& members, uint64_t seq,
                         const std::string& call, const std::vector<int>& problem) {
  const Posted mine = Posted::of_call(group, members, seq, call, host_);
  std::map<int, Posted> seen{{rank_, mine}};
  // A member that raised meanwhile has told its side of the story: raise the same text.
  auto look = [&](int q) {
    seen[q] = read_current(q);
    if (seen[q].kind == Posted::kError) post_and_throw(CommError(seen[q].how));
  };
  for (int q : members)
    if (q != rank_) look(q);
  // The side that the lowest-ranked party of the disagreement is on tells the story,
  // so that both sides of a two-rank disagreement raise the same text.
  Posted anchor = mine;
  std::vector<int> others = problem;
  int low = *std::min_element(problem.begin(), problem.end());
  std::vector<int> agreeing;
  for (int q : members)
    if (seen[q].same_call(gkey, seq, call)) agreeing.push_back(q);
  if (low < agreeing.front() && seen[low].kind == Posted::kCall) {
    anchor = seen[low];
    for (int q : anchor.members)
      if (!seen.count(q)) look(q);
    agreeing.clear();
    others.clear();
    for (int q : anchor.members) {
      if (seen[q].same_call(anchor.key(), anchor.seq, anchor.call))
        agreeing.push_back(q);
      else if (q == rank_ || contains(problem, q))
        others.push_back(q);
    }
    if (others.empty()) others.push_back(rank_);
  }
  std::sort(others.begin(), others.end());
  std::string parts;
  for (int q : others)
    parts += str_cat(parts.empty() ? "" : ", ", "rank ", q, " ", describe(seen[q]));
  post_and_throw(CommError(str_cat(
      "smp: ranks ", list(agreeing), " of the ", anchor.group, " group ", list(anchor.members),
      " called ", anchor.call, " (call #", anchor.seq, " on that group), but ", parts,
      "; every rank of a group must make the same smp calls in the same order")));
}

// Posts the error as this rank's current state, so that members still waiting for this
// rank raise the same text (and this rank's exit does not replace it), then throws it.
template <typename E>
void CallAgreement::post_and_throw(const E& error) {
  Posted p;
  p.kind = Posted::kError;
  p.how = first_line(error.what());
  const std::string enc = p.encode();
  store_set_sealed(store_, str_cat(prefix_, "/cur/", rank_), enc);
  failed_.store(true);
  throw error;
}

void CallAgreement::agree(const std::string& group, const std::vector<int>& members,
                          const std::string& call) {
  if (members.size() <= 1) return;
  SMP_CHECK(contains(members, rank_), "CallAgreement: rank ", rank_, " is not in the ",
            group, " group ", list(members));
  const std::string gkey = group + ":" + csv(members);
  const int64_t size = static_cast<int64_t>(members.size());
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    seq = ++seq_[gkey];
  }
  const Posted mine = Posted::of_call(group, members, seq, call, host_);
  const std::string counter = str_cat(prefix_, "/n/", gkey, "/", seq, "/", call);
  const std::string what = str_cat("ranks ", list({rank_}), " of the ", group, " group ",
                                   list(members), " called ", call, " (call #", seq,
                                   " on that group)");
  // The store's host (rank 0 under smprun) may be gone: say what this rank was doing.
  auto lost = [&](const std::exception& e) {
    return CommError(str_cat("smp: ", what, ", but the connection to the job's store was "
                             "lost (its host, rank 0 under smprun, exited or failed without "
                             "making that call): ", first_line(e.what())));
  };
  try {
    const std::string enc = mine.encode();
    store_set_sealed(store_, str_cat(prefix_, "/cur/", rank_), enc);
    int64_t n = store_->add(counter, 1);
    std::string old;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& sent = sent_[gkey];
      sent.push_back(counter);
      if (sent.size() > 2) {  // every member is past call #seq-2 (it needed this rank)
        old = sent.front();
        sent.erase(sent.begin());
      }
    }
    if (!old.empty() && members[0] == rank_) store_->deleteKey(old);

    const auto start = Clock::now();
    const auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(timeout_s_));
    auto next_look = start + std::chrono::milliseconds(20);
    auto pause = std::chrono::microseconds(500);
    while (n < size) {
      auto now = Clock::now();
      if (now >= next_look) {
        std::vector<int> problem;
        std::string posted_error;  // a disagreement a member found: raise the same text
        for (int q : members) {
          if (q == rank_) continue;
          Posted p = read_current(q);
          if (p.kind == Posted::kError)
            posted_error = p.how;
          else if (p.kind == Posted::kExited ||
                   (p.kind == Posted::kCall && p.key() == gkey && p.seq == seq &&
                    p.call != call) ||
                   (p.kind == Posted::kCall && p.key() != gkey && waits_for_me(p)))
            problem.push_back(q);
        }
        if (!posted_error.empty() || !problem.empty()) {
          if (store_->add(counter, 0) >= size) break;  // every member arrived meanwhile
          if (!posted_error.empty()) post_and_throw(CommError(posted_error));
          fail(gkey, group, members, seq, call, problem);
        }
        next_look = now + std::chrono::milliseconds(100);
      }
      if (now >= deadline) {
        std::vector<int> missing, arrived;
        std::string last;
        for (int q : members) {
          Posted p = q == rank_ ? mine : read_current(q);
          if (p.same_call(gkey, seq, call)) {
            arrived.push_back(q);
          } else {
            missing.push_back(q);
            last += str_cat("; rank ", q, p.kind == Posted::kCall ? " last " : " ", describe(p));
          }
        }
        post_and_throw(TimeoutError(str_cat(
            "smp: timed out after ", timeout_s_, " s waiting for ranks ", list(missing),
            " of the ", group, " group ", list(members), " to call ", call, " (call #", seq,
            " on that group; ranks ", list(arrived), " called it)", last)));
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(10000));
      n = store_->add(counter, 0);
    }
  } catch (const CommError&) {
    throw;
  } catch (const std::exception& e) {
    throw lost(e);
  }
}

void CallAgreement::mark_exited(const std::string& how, double linger_s) {
  Posted gone;
  gone.kind = Posted::kExited;
  gone.how = first_line(how);
  try {
    const std::string enc = gone.encode();
    if (!failed_)  // an error this rank raised in a call says more than "exited"
      store_set_sealed(store_, str_cat(prefix_, "/cur/", rank_), enc);
    store_->set(str_cat(prefix_, "/gone/", rank_), std::vector<uint8_t>{1});
    if (linger_s <= 0 || !is_initialized()) return;
    const int world = runtime().env().world_size;
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(linger_s));
    while (Clock::now() < deadline) {
      bool in_use = false;  // a peer that has not marked itself gone may use the store
      for (int q = 0; q < world && !in_use; ++q)
        in_use = q != rank_ && !store_->check({str_cat(prefix_, "/gone/", q)}) &&
                 read_current(q).kind != Posted::kExited;  // (killed: its pid is gone)
      if (!in_use) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  } catch (const std::exception&) {
    // The store is gone already: nobody can read the mark.
  }
}

namespace {
std::mutex held_mu;
std::unique_ptr<CallAgreement> held;  // holds a reference to the runtime's store
}  // namespace

CallAgreement& call_agreement() {
  std::lock_guard<std::mutex> lock(held_mu);
  Runtime& rt = runtime();
  if (!held || held->store().get() != rt.store().get())
    held = std::make_unique<CallAgreement>(rt.store(), rt.rank(), rt.config().timeout_s);
  return *held;
}

void release_call_agreement() {
  std::lock_guard<std::mutex> lock(held_mu);
  held.reset();
}

}  // namespace smp
