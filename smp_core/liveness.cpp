#include "smp_core/liveness.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "smp_core/comm.h"
#include "smp_core/detail/tcp_mesh.h"
#include "smp_core/errors.h"
#include "smp_core/runtime.h"

namespace smp {

// Note [Rank heartbeat]
// ~~~~~~~~~~~~~~~~~~~~~
// smprun's launchers heartbeat each other and stop every rank when a host is lost
// (launcher/control_channel.cpp). torchrun, srun and mpirun have nothing of the kind
// between hosts that reaches a rank in time: a rank whose peer host was cut off waits
// in Gloo for the whole timeout_s (300 s by default). So where a job spans hosts and
// smprun did not start it, every rank runs a thread that, each second, adds 1 to its
// own counter in the c10d store (over a store connection of its own, so a long wait on
// the main thread's store never delays it) and reads the counter of the first rank of
// every other host. Whichever comes first stops the rank with exit code 1, after one
// line naming the host and its ranks:
// - another host's counter has not moved for SMP_RANK_HEARTBEAT_S (default 10 s):
//   "ranks 2-3 on host 'host1' sent no heartbeat for 10 s";
// - this rank could not reach the store for that long: "cannot reach the store at
//   ADDR:PORT (on host 'host0', ranks 0-1) for 10 s".
// Exiting is the only way out of a collective that waits on a peer that is gone (NCCL's
// watchdog does the same); the launcher then stops the host's other ranks. A rank
// that ends normally (smp.shutdown, or the interpreter's exit) marks itself done, and
// nobody reports it. Cost: two store round trips a second per rank, and one per other
// host. Under smprun (SMP_LAUNCHER=smprun) the default is 0 (off): its launchers do it.

namespace {

constexpr int64_t kDone = int64_t{1} << 50;  // added to a counter at a normal end

// Two threads: the pinger talks to the store (a call on a cut link can block for
// minutes: TCP's own retransmission timeout) and is detached; the judge, which never
// touches the network, looks each second at when the pinger last got through and at
// what it saw of the other hosts, and stops the rank.
class Liveness {
 public:
  Liveness(std::string addr, int port, std::string prefix, int rank,
           std::vector<std::pair<int, std::string>> watched, std::string store_host,
           std::string me, double stale_s)
      : s_(std::make_shared<Shared>()) {
    s_->addr = std::move(addr);
    s_->port = port;
    s_->prefix = std::move(prefix);
    s_->rank = rank;
    s_->watched = std::move(watched);
    s_->store_host = std::move(store_host);
    s_->me = std::move(me);
    s_->stale_s = stale_s;
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(port);
    opts.isServer = false;
    opts.waitWorkers = false;
    opts.timeout = std::chrono::milliseconds(2000);
    s_->store = c10::make_intrusive<c10d::TCPStore>(s_->addr, opts);
    s_->store->add(s_->key(rank), 1);
    s_->reached = Clock::now();
    std::thread([s = s_] { ping(*s); }).detach();
    judge_ = std::thread([s = s_] { judge(*s); });
  }

  // Marks this rank done (waiting up to 2 s for the pinger to say so) and stops.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      if (s_->stopping) return;
      s_->stopping = true;
    }
    s_->cv.notify_all();
    if (judge_.joinable()) judge_.join();
    std::unique_lock<std::mutex> lock(s_->mu);
    s_->cv.wait_for(lock, std::chrono::seconds(2), [this] { return s_->done; });
  }

  ~Liveness() { stop(); }

 private:
  using Clock = std::chrono::steady_clock;
  struct Shared {
    std::string addr, prefix, store_host, me;
    int port = 0, rank = 0;
    std::vector<std::pair<int, std::string>> watched;  // first rank of each other host
    double stale_s = 10;
    c10::intrusive_ptr<c10d::TCPStore> store;
    std::mutex mu;
    std::condition_variable cv;
    bool stopping = false, done = false;
    Clock::time_point reached;  // the pinger's last round trip
    std::string lost;           // a silent host, as the pinger saw it
    std::string last_error;
    std::string key(int r) const { return str_cat(prefix, r); }
  };

  static double since(Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  }

  static void ping(Shared& s) {
    std::map<int, std::pair<int64_t, Clock::time_point>> seen;  // rank -> (count, since)
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(s.mu);
        if (s.cv.wait_for(lock, std::chrono::seconds(1), [&] { return s.stopping; })) break;
      }
      try {
        s.store->add(s.key(s.rank), 1);
        std::string lost;
        for (const auto& [r, host] : s.watched) {
          const int64_t n = s.store->add(s.key(r), 0);
          if (n >= kDone) continue;
          auto it = seen.find(r);
          if (it == seen.end() || it->second.first != n)
            seen[r] = {n, Clock::now()};
          else if (lost.empty() && since(it->second.second) >= s.stale_s)
            lost = str_cat(host, " sent no heartbeat for ",
                           static_cast<int>(since(it->second.second)),
                           " s (its link is down, or its processes stopped)");
        }
        std::lock_guard<std::mutex> lock(s.mu);
        s.reached = Clock::now();
        if (s.lost.empty()) s.lost = lost;
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(s.mu);
        s.last_error = e.what();
      }
    }
    try {
      s.store->add(s.key(s.rank), kDone);
    } catch (const std::exception&) {
      // The store is gone: nobody is left to report this rank either.
    }
    std::lock_guard<std::mutex> lock(s.mu);
    s.done = true;
    s.cv.notify_all();
  }

  static void judge(Shared& s) {
    std::unique_lock<std::mutex> lock(s.mu);
    while (!s.cv.wait_for(lock, std::chrono::seconds(1), [&] { return s.stopping; })) {
      std::string why = s.lost;
      if (why.empty() && since(s.reached) >= s.stale_s)
        why = str_cat("cannot reach the store at ", s.addr, ":", s.port, " (on ", s.store_host,
                      ") for ", static_cast<int>(since(s.reached)), " s",
                      s.last_error.empty() ? "" : " (" + s.last_error + ")");
      if (why.empty()) continue;
      std::fprintf(stderr, "smp: rank %d (%s): %s; stopping this rank (SMP_RANK_HEARTBEAT_S=%g, "
                   "Note [Rank heartbeat])\n", s.rank, s.me.c_str(), why.c_str(), s.stale_s);
      std::fflush(stderr);
      std::_Exit(1);
    }
  }

  std::shared_ptr<Shared> s_;
  std::thread judge_;
};

std::mutex g_mu;
std::unique_ptr<Liveness> g_liveness;

// "ranks 2-3 on host 'host1'" (ranks listed as runs).
std::string ranks_on(const std::vector<int>& ranks, const std::string& host) {
  std::string s;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    s += str_cat(s.empty() ? "" : ",", ranks[i], j > i ? str_cat("-", ranks[j]) : "");
    i = j + 1;
  }
  return str_cat(ranks.size() == 1 ? "rank " : "ranks ", s, " on host '", host, "'");
}

}  // namespace

std::string start_liveness() {
  Runtime& rt = runtime();
  const ProcessEnv& env = rt.env();
  if (env.world_size < 2 || !rt.groups().world) return "";
  const char* launcher = std::getenv("SMP_LAUNCHER");
  const bool smprun = launcher && std::string(launcher) == "smprun";
  const int stale = env_int("SMP_RANK_HEARTBEAT_S", smprun ? 0 : 10);
  if (stale < 0)
    throw ConfigError(str_cat("smp: environment SMP_RANK_HEARTBEAT_S='", stale,
                              "' is not a number of seconds >= 0 (0: off)"));
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  const std::string address = detail::local_address_toward(env.master_addr);
  auto all = allgather_bytes(rt.groups().world, str_cat(stale, "|", address, "|", host),
                             rt.config().timeout_s, "the host names of every rank (smp.init)");
  std::vector<std::string> addresses;
  std::vector<std::string> hosts;
  std::map<std::string, std::vector<int>> ranks_of;
  std::vector<std::string> order;  // hosts by their first rank
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    const size_t bar = all[r].find('|');
    if (all[r].substr(0, bar) != all[0].substr(0, all[0].find('|')))
      throw ConfigError(str_cat("smp: environment SMP_RANK_HEARTBEAT_S differs between ranks: ",
                                all[0].substr(0, all[0].find('|')), " on rank 0, ",
                                all[r].substr(0, bar), " on rank ", r,
                                " (set it alike on every host)"));
    const size_t bar2 = all[r].find('|', bar + 1);
    addresses.push_back(all[r].substr(bar + 1, bar2 - bar - 1));
    hosts.push_back(all[r].substr(bar2 + 1));
    if (ranks_of[hosts.back()].empty()) order.push_back(hosts.back());
    ranks_of[hosts.back()].push_back(r);
  }
  if (order.size() < 2) return "";
  // Note [Peers by address] (comm.cpp): Gloo's errors name peers by address.
  std::map<std::string, std::vector<int>> at;
  for (int r = 0; r < static_cast<int>(addresses.size()); ++r) at[addresses[r]].push_back(r);
  std::vector<std::pair<std::string, std::string>> by_address;
  for (const auto& [a, rs] : at)
    if (!a.empty()) by_address.emplace_back(a, ranks_on(rs, hosts[rs.front()]));
  set_peer_names(std::move(by_address));
  if (stale == 0 || env.master_port == 0) return "";
  std::vector<std::pair<int, std::string>> watched;
  for (const auto& h : order)
    if (h != hosts[env.rank]) watched.emplace_back(ranks_of[h].front(), ranks_on(ranks_of[h], h));
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  if (!attempt) attempt = std::getenv("SMP_RESTART_COUNT");
  // Every rank beats or none does (a rank that cannot would be reported by the others):
  // the outcomes are agreed before any thread judges.
  std::unique_ptr<Liveness> mine;
  std::string failed;
  try {
    mine = std::make_unique<Liveness>(
        env.master_addr, env.master_port, str_cat("smp/alive/", attempt ? attempt : "0", "/"),
        env.rank, std::move(watched), ranks_on(ranks_of[hosts[0]], hosts[0]),
        str_cat("host '", hosts[env.rank], "'"), stale);
  } catch (const std::exception& e) {
    failed = e.what();
    failed = failed.substr(0, failed.find('\n'));
    if (failed.empty()) failed = "unknown error";
  }
  auto outcomes = allgather_bytes(rt.groups().world, failed, rt.config().timeout_s,
                                  "the rank heartbeats' start (smp.init)");
  for (size_t r = 0; r < outcomes.size(); ++r) {
    if (outcomes[r].empty()) continue;
    if (mine) mine->stop();
    return str_cat("no rank heartbeats: rank ", r, " could not open its store connection to ",
                   env.master_addr, ":", env.master_port, " (", outcomes[r], ")");
  }
  std::lock_guard<std::mutex> lock(g_mu);
  g_liveness = std::move(mine);
  return str_cat("rank heartbeats through the store at ", env.master_addr, ":", env.master_port,
                 ": a host silent for ", stale, " s stops the job (", order.size(),
                 " hosts; Note [Rank heartbeat])");
}

void stop_liveness() {
  std::unique_ptr<Liveness> l;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    l = std::move(g_liveness);
  }
  if (l) l->stop();
}

}  // namespace smp
