#include "smp_core/comm.h"

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "smp_common/auth.h"
#include "smp_core/compat/torch_compat.h"
#include "smp_core/errors.h"

#include <algorithm>
#include <mutex>
#include <thread>

namespace smp {
namespace {

std::chrono::milliseconds to_ms(double s) {
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000.0));
}

// torch errors carry a C++ backtrace after the first line; users need the first.
std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

bool looks_like_timeout(const std::string& msg) {
  return msg.find("imeout") != std::string::npos || msg.find("imed out") != std::string::npos;
}

at::Tensor bytes_tensor(const std::string& s, int64_t size) {
  auto t = at::zeros({size}, at::kByte);
  if (!s.empty()) std::memcpy(t.data_ptr(), s.data(), s.size());
  return t;
}

}  // namespace

// Note [Peers by address]
// Gloo names a peer that failed by its address ("Read error [10.77.0.2]:37029:
// Connection reset"). smp.init exchanges every rank's address toward the master with
// its host name (start_liveness, liveness.cpp), so a failed collective's message also
// says whose address that is: the host and the ranks a user can act on.
namespace {
std::mutex g_peer_mu;
std::vector<std::pair<std::string, std::string>> g_peer_names;
}  // namespace

void set_peer_names(std::vector<std::pair<std::string, std::string>> by_address) {
  std::lock_guard<std::mutex> lock(g_peer_mu);
  g_peer_names = std::move(by_address);
}

std::string with_peer_names(const std::string& msg) {
  std::lock_guard<std::mutex> lock(g_peer_mu);
  std::string said;
  for (const auto& [addr, who] : g_peer_names)
    if (msg.find("[" + addr + "]") != std::string::npos)
      said += str_cat(said.empty() ? "" : "; ", addr, " is ", who);
  return said.empty() ? msg : str_cat(msg, " (", said, ")");
}

void wait_work(const c10::intrusive_ptr<c10d::Work>& work, double timeout_s,
               const std::string& what) {
  try {
    work->wait(to_ms(timeout_s));
  } catch (const std::exception& e) {
    std::string msg = e.what();
    if (looks_like_timeout(msg))
      throw TimeoutError(str_cat("smp: timed out after ", timeout_s, " s waiting for ", what,
                                 ": ", first_line(msg)));
    throw CommError(str_cat("smp: ", what, " failed: ", with_peer_names(first_line(msg))));
  }
}

std::vector<std::string> allgather_bytes(const ProcessGroupPtr& pg, const std::string& data,
                                         double timeout_s, const std::string& what) {
  const int n = pg->getSize();
  std::vector<at::Tensor> in_len = {at::full({1}, static_cast<int64_t>(data.size()), at::kLong)};
  std::vector<std::vector<at::Tensor>> out_len(1);
  for (int i = 0; i < n; ++i) out_len[0].push_back(at::empty({1}, at::kLong));
  wait_work(pg->allgather(out_len, in_len), timeout_s, what + " (sizes)");
  int64_t max_len = 1;
  for (auto& t : out_len[0]) max_len = std::max(max_len, t.item<int64_t>());
  std::vector<at::Tensor> in = {bytes_tensor(data, max_len)};
  std::vector<std::vector<at::Tensor>> out(1);
  for (int i = 0; i < n; ++i) out[0].push_back(at::empty({max_len}, at::kByte));
  wait_work(pg->allgather(out, in), timeout_s, what);
  std::vector<std::string> result;
  for (int i = 0; i < n; ++i) {
    auto len = out_len[0][i].item<int64_t>();
    result.emplace_back(static_cast<const char*>(out[0][i].data_ptr()), len);
  }
  return result;
}

std::string broadcast_bytes(const ProcessGroupPtr& pg, const std::string& data, int root,
                            double timeout_s, const std::string& what) {
  const bool me = pg->getRank() == root;
  std::vector<at::Tensor> len = {at::full({1}, me ? static_cast<int64_t>(data.size()) : 0, at::kLong)};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  wait_work(pg->broadcast(len, opts), timeout_s, what + " (size)");
  int64_t n = len[0].item<int64_t>();
  std::vector<at::Tensor> buf = {me ? bytes_tensor(data, std::max<int64_t>(n, 1))
                                    : at::empty({std::max<int64_t>(n, 1)}, at::kByte)};
  wait_work(pg->broadcast(buf, opts), timeout_s, what);
  return std::string(static_cast<const char*>(buf[0].data_ptr()), n);
}

void barrier(const ProcessGroupPtr& pg, double timeout_s, const std::string& what) {
  wait_work(pg->barrier(), timeout_s, what);
}

void store_set_sealed(const StorePtr& store, const std::string& key, const std::string& value) {
  const std::string sealed = auth::seal(key, value);
  store->set(key, std::vector<uint8_t>(sealed.begin(), sealed.end()));
}

std::string store_get_sealed(const StorePtr& store, const std::string& key) {
  const auto v = store->get(key);
  try {
    return auth::unseal(key, std::string(v.begin(), v.end()));
  } catch (const std::runtime_error& e) {
    throw CommError(e.what());
  }
}

void post_failure(const StorePtr& store, const std::string& prefix, int rank, int64_t step,
                  const std::string& why) {
  store_set_sealed(store, str_cat(prefix, "/", rank, "/", step), why);
}

std::string posted_failure(const StorePtr& store, const std::string& prefix,
                           const std::vector<int>& peers, int64_t step) {
  for (int q : peers) {
    const std::string key = str_cat(prefix, "/", q, "/", step);
    try {
      if (store->check({key})) return store_get_sealed(store, key);
    } catch (const CommError&) {
      throw;  // a forged post: refused, and said
    } catch (const std::exception&) {
      return "";  // the store is gone: the wait's own error will say more
    }
  }
  return "";
}

bool establish_job_key(const StorePtr& store, int rank, int world_size, double timeout_s) {
  std::string secret;
  try {
    secret = auth::secret_from_env();
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  const bool from_env = !secret.empty();
  if (!from_env) {
    // Note [Job secret]: no secret was given; rank 0 draws one. compareSet keeps the
    // first one drawn should this store see a second init; the helper also wakes the
    // ranks already waiting for it (torch 1.13's compareSet does not).
    const std::string key = "smp/auth/drawn_secret";
    if (rank == 0) {
      const std::string mine = auth::to_hex(auth::random_bytes(auth::kKeyBytes));
      const auto got = compat::compare_set_and_wake(
          store, key, {}, std::vector<uint8_t>(mine.begin(), mine.end()));
      secret.assign(got.begin(), got.end());
    } else {
      try {
        store->wait({key}, to_ms(timeout_s));
      } catch (const std::exception& e) {
        throw TimeoutError(str_cat("smp: timed out after ", timeout_s, " s waiting for rank 0 to "
                                   "publish the job's key in the store (on rank ", rank, "): ",
                                   first_line(e.what())));
      }
      const auto got = store->get(key);
      secret.assign(got.begin(), got.end());
    }
  }
  try {
    auth::set_job_key(auth::key_from_secret(secret, from_env ? auth::kSecretEnv : "the drawn secret"),
                      from_env);
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  return from_env;
}

std::vector<std::string> store_exchange(const StorePtr& store, const std::string& key, int rank,
                                        int world_size, const std::string& value,
                                        double timeout_s, const std::string& what) {
  store_set_sealed(store, str_cat(key, "/", rank), value);
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(str_cat(key, "/", r));
  // Poll rather than wait on all keys at once, so a timeout can name who is missing
  // without asking the store again (its host may be gone by then).
  std::vector<bool> seen(world_size, false);
  int n_seen = 0;
  auto deadline = std::chrono::steady_clock::now() + to_ms(timeout_s);
  auto pause = std::chrono::milliseconds(1);
  while (true) {
    for (int r = 0; r < world_size; ++r) {
      if (seen[r]) continue;
      try {
        seen[r] = store->check({keys[r]});
      } catch (const std::exception& e) {
        throw CommError(str_cat("smp: lost the connection to the job's store (hosted by rank 0) "
                                "while waiting for ", what, " on rank ", rank, ": ",
                                first_line(e.what())));
      }
      n_seen += seen[r];
    }
    if (n_seen == world_size) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      std::string missing;
      for (int r = 0; r < world_size; ++r)
        if (!seen[r]) missing += str_cat(missing.empty() ? "" : ",", r);
      // Rank 0 hosts the store: linger so the other ranks can read their own
      // timeout instead of a reset connection.
      if (rank == 0) std::this_thread::sleep_for(to_ms(std::min(2.0, timeout_s)));
      throw TimeoutError(str_cat("smp: timed out after ", timeout_s, " s waiting for ", what,
                                 " from rank(s) ", missing, " (on rank ", rank, ")"));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(5));  // a check is one store round trip
  }
  std::vector<std::string> out;
  std::string forged;
  for (int r = 0; r < world_size; ++r) {
    auto v = store->get(keys[r]);
    try {
      out.push_back(auth::unseal(keys[r], std::string(v.begin(), v.end())));
    } catch (const std::runtime_error&) {
      forged += str_cat(forged.empty() ? "" : ",", r);
    }
  }
  if (!forged.empty()) {
    // As for a timeout: rank 0 hosts the store, and lingers so that every rank reads
    // the values and raises this error too, rather than a reset connection.
    if (rank == 0) std::this_thread::sleep_for(to_ms(std::min(2.0, timeout_s)));
    throw CommError(str_cat("smp: ", what, " from rank(s) ", forged, " failed authentication on rank ",
                            rank, ": those ranks hold another job secret (SMP_JOB_SECRET differs "
                            "between nodes?), or a process outside the job wrote '", key,
                            "/<rank>' in the store"));
  }
  return out;
}

StoreMailbox::StoreMailbox(StorePtr store, int rank, double timeout_s, std::string prefix)
    : store_(std::move(store)), rank_(rank), timeout_s_(timeout_s), prefix_(std::move(prefix)) {}

StoreMailbox::~StoreMailbox() = default;

void StoreMailbox::send(int dst, const std::string& bytes) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    seq = send_seq_[dst]++;
  }
  store_set_sealed(store_, str_cat(prefix_, "/", rank_, "/", dst, "/", seq), bytes);
}

std::string StoreMailbox::recv(int src) {
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(mu_);
    seq = recv_seq_[src]++;
  }
  std::string key = str_cat(prefix_, "/", src, "/", rank_, "/", seq);
  try {
    store_->wait({key}, to_ms(timeout_s_));
  } catch (const std::exception& e) {
    throw TimeoutError(str_cat("smp: timed out after ", timeout_s_,
                               " s waiting for message #", seq, " from rank ", src,
                               " on rank ", rank_, " (smp.recv_from): ", first_line(e.what())));
  }
  std::string v = store_get_sealed(store_, key);  // refused before the caller unpickles it
  store_->deleteKey(key);
  return v;
}

}  // namespace smp
