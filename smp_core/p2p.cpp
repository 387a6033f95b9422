// The pipeline engine's transport and mailbox: the mesh's sockets, send() as one
// gathered write (Note [Wire format], Note [Layout travels]), a receiver thread per peer
// reading each message straight into fresh tensors, the mailbox and recv() (Note
// [Receive order], Note [Step epochs]). The compute token is detail/compute_token.cpp's;
// both share P2PEngine::Impl (detail/p2p_impl.h).
//
// Threads: receive_loop() runs on the receiver threads this engine starts, one per peer,
// and is the only reader of its socket; send() on any thread, one sender per peer at a
// time under that peer's `send_mu` (never with `mu` held; a c10d payload goes under it
// too, in descriptor order); recv() on any task thread, waiting on its own condition
// variable (Note [Targeted wakeups]) and, with `yield_token`, giving up the compute
// token meanwhile. State: the mailbox, its waiters, `fatal`, `epoch` and the stats under
// `mu`; the payload group under `mu` too (set once, right after construction).
#include "smp_core/p2p.h"
#include "smp_core/plan.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include <sys/socket.h>
#include <unistd.h>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "smp_common/auth.h"
#include "smp_core/comm.h"
#include "smp_core/detail/p2p_impl.h"
#include "smp_core/detail/tcp_mesh.h"
#include "smp_core/detail/wire.h"
#include "smp_core/errors.h"
#include "smp_core/task.h"
#include "smp_core/task_rng.h"

namespace smp {
namespace {

using namespace detail::wire;  // the format's constants (detail/wire.h)

// Note [Wire format]: a message is ONE gathered write on the peer's socket: kFixedWords
// header words, then per tensor kWordsPerTensor descriptor words, then the meta bytes,
// then the rng bytes (Message::rng), then each tensor's bytes (contiguous, no padding).
// The receiver reads the header,
// then the descriptors and meta, then each tensor's bytes directly into a new tensor.
// A header with total_bytes 0 says the sender's engine is shutting down.
//
// Header, all int64: magic, total_bytes, mb, call_id, kind, meta_len, n_tensors, epoch,
// rng_len, autocast (Message::autocast); per tensor: dtype | flags, ndim, dims[kMaxDims],
// strides[kMaxDims]. Flags: kByC10d (the bytes follow by c10d send/recv, not on the
// socket), kOnCuda (a CUDA tensor).
//
// Note [Layout travels]: a tensor arrives with the strides it was sent with when its
// elements are dense and do not overlap (a transposed view, a channels-last batch):
// its memory goes as it is, no copy, and the receiver allocates the same layout. A
// module then sees the layout it would see in one process; that matters beyond speed,
// as torch's Dropout draws its mask in memory order (empty_like keeps the strides), so
// a transposed input crossing ranks would otherwise get another mask. Any other view
// goes contiguous.
// The receiver checks every word (detail/wire.h: decode_header, decode_tensor,
// check_total) before it allocates: a peer cannot make it allocate or read beyond the
// message it described (fuzzed by tests/fuzz/wire_fuzz.cpp).
// c10d tag of payload tensors: the group is the engine's own, and per pair of ranks the
// sends (one sender thread at a time, under the peer's send mutex) and the receives
// (one receiver thread per peer) run in the same order.
constexpr int kPayloadTag = 0;

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// The memory of a dense, non-overlapping tensor as a contiguous 1-D tensor (a view):
// what the wire carries (Note [Layout travels]).
at::Tensor flat(const at::Tensor& dense) { return dense.as_strided({dense.numel()}, {1}); }

// The rest of a message whose header arrived: a close now is a cut message.
void read_or_fail(int fd, void* buf, size_t n) {
  if (!detail::read_exact(fd, buf, n))
    throw CommError("the connection was closed in the middle of a message");
}

// detail::wire::ElementSize for this build's torch: 0 for a value that is no dtype.
int element_size(int dtype) {
  if (dtype < 0 || dtype >= static_cast<int>(at::ScalarType::NumOptions)) return 0;
  try {
    return static_cast<int>(c10::elementSize(static_cast<at::ScalarType>(dtype)));
  } catch (const std::exception&) {
    return 0;
  }
}

// Note [Late messages after a peer left].
constexpr std::chrono::milliseconds kFatalGrace{1000};

}  // namespace

bool P2PEngine::Impl::by_c10d(const at::Tensor& t) const {
  if (transport == PayloadTransport::kC10d) return true;
  return transport == PayloadTransport::kAuto && !t.device().is_cpu();
}

c10::intrusive_ptr<c10d::ProcessGroup> P2PEngine::Impl::payload_group(int peer) {
  std::unique_lock<std::mutex> lock(mu);
  const auto limit = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  if (!payload_set.wait_for(lock, limit, [&] { return payload_pg || stopping; }) || !payload_pg)
    throw CommError(str_cat("smp: pp rank ", peer, " sent a tensor by c10d send/recv but "
                            "this rank has no payload group (config 'p2p_transport' differs "
                            "between ranks?)"));
  return payload_pg;
}

void P2PEngine::Impl::wait_payload(const c10::intrusive_ptr<c10d::Work>& work,
                                   const std::string& what) {
  wait_work(work, timeout_s, what);
}

void P2PEngine::Impl::receive_loop(int peer) {
  const int fd = fds[peer];
  try {
    while (true) {
      int64_t w[kFixedWords];
      if (!detail::read_exact(fd, w, sizeof w))
        throw CommError("the connection was closed");
      const Header h = decode_header(w);
      if (h.closing) {  // the peer's engine is shutting down: nothing more will come
        fail(str_cat("smp: pp rank ", peer, " closed its pipeline engine (seen on pp rank ",
                     rank, ")"));
        return;
      }
      const int64_t total = h.total;
      Message m;
      m.src = peer;
      m.mb = h.mb;
      m.call_id = h.call_id;
      m.kind = h.kind;
      m.epoch = h.epoch;
      m.autocast = h.autocast;
      std::vector<int64_t> desc(static_cast<size_t>(h.n_tensors) * kWordsPerTensor);
      if (!desc.empty()) read_or_fail(fd, desc.data(), desc.size() * 8);
      std::vector<TensorSpec> specs;
      for (int64_t i = 0; i < h.n_tensors; ++i)
        specs.push_back(decode_tensor(desc.data() + i * kWordsPerTensor, element_size));
      check_total(h, specs);  // before a byte more is read or allocated
      m.meta.resize(static_cast<size_t>(h.meta_len));
      m.rng.resize(static_cast<size_t>(h.rng_len));
      if (h.meta_len) read_or_fail(fd, m.meta.data(), m.meta.size());
      if (h.rng_len) read_or_fail(fd, m.rng.data(), m.rng.size());
      for (const TensorSpec& s : specs) {
        // Taken under the lock: orders this read of `device` after set_payload_group.
        c10::intrusive_ptr<c10d::ProcessGroup> group;
        if (s.by_c10d) group = payload_group(peer);
        const at::Device where = s.on_cuda ? device : at::Device(at::kCPU);
        auto tensor = at::empty_strided(
            s.sizes, s.strides,
            at::TensorOptions().dtype(static_cast<at::ScalarType>(s.dtype)).device(where));
        if (s.by_c10d) {
          std::vector<at::Tensor> one{flat(tensor)};
          wait_payload(group->recv(one, peer, kPayloadTag),
                       str_cat("a pipeline tensor from pp rank ", peer, " (c10d recv)"));
        } else if (s.nbytes) {
          read_or_fail(fd, tensor.data_ptr(), static_cast<size_t>(s.nbytes));
        }
        m.tensors.push_back(std::move(tensor));
      }
      std::lock_guard<std::mutex> lock(mu);
      stats.messages_received++;
      stats.bytes_received += total;
      deliver_locked(std::move(m));
    }
  } catch (const std::exception& e) {
    fail(str_cat("smp: lost the pipeline connection to pp rank ", peer, " (on pp rank ", rank,
                 "): ", first_line(e.what())));
  }
}

void P2PEngine::Impl::fail(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu);
  if (!stopping && fatal.empty()) {
    fatal = why;
    fatal_since = std::chrono::steady_clock::now();
  }
  for (auto* w : mail_waiters) w->cv.notify_one();
  unorder_locked();
  end_serial_locked();  // Note [Leaving a plan under tp]: no wait outlives a failure
}

void P2PEngine::Impl::deliver_locked(Message m) {
  // Note [Planned token order]; Note [Leaving a plan under tp] for the deferred kPlanOff.
  if (ends_order(m) && !(m.kind == kPlanOff && plan_off_deferred)) unorder_locked();
  if (m.epoch == epoch && m.kind == kPlanOff) go_serial_locked();  // Note [Leaving a plan under tp]  // Note [Leaving a plan under tp]
  if (m.epoch == epoch && m.kind == kAbort) end_serial_locked();
  mailbox.push_back(std::move(m));
  const Message& back = mailbox.back();
  for (auto* w : mail_waiters)
    if (matches(back, w->mb, w->call_id, w->mask)) w->cv.notify_one();
}

bool P2PEngine::Impl::ends_order(const Message& m) const {
  return m.epoch == epoch && (m.kind == kAbort || m.kind == kStepEnd || m.kind == kPlanOff);
}

bool P2PEngine::Impl::matches(const Message& m, int64_t mb, int64_t call_id,
                              uint32_t mask) const {
  if (m.epoch != epoch || !(mask & (1u << m.kind))) return false;
  bool step_level = m.kind == kStepEnd || m.kind == kAbort || m.kind == kPlanOff;
  if (!step_level && mb != kAny && m.mb != mb) return false;
  return call_id == kAny || m.call_id == call_id;
}

P2PEngine::P2PEngine(c10::intrusive_ptr<c10d::Store> store, const std::string& prefix, int rank,
                     int size, double timeout_s, const std::string& master_addr)
    : impl_(std::make_unique<Impl>()) {
  auto& I = *impl_;
  SMP_CHECK(size >= 1 && rank >= 0 && rank < size, "p2p: rank ", rank, " outside a group of ", size);
  I.timeout_s = timeout_s;
  I.rank = rank;
  I.size = size;
  I.fds.assign(size, -1);
  if (size > 1) {
    const char* forced = std::getenv("SMP_P2P_ADDR");
    std::string host = forced && *forced ? forced : detail::local_address_toward(master_addr);
    detail::Listener listener(host, detail::local_sockets_enabled());
    auto addresses = store_exchange(store, prefix + "/addr", rank, size, listener.address(),
                                    timeout_s, "the pipeline transport's addresses");
    I.fds = detail::connect_mesh(listener, rank, addresses, std::hash<std::string>{}(prefix),
                                 auth::job_key(), timeout_s);
  }
  for (int r = 0; r < size; ++r) I.send_mu.push_back(std::make_unique<std::mutex>());
  for (int r = 0; r < size; ++r)
    if (r != rank) I.receivers.emplace_back([this, r] { impl_->receive_loop(r); });
}

P2PEngine::~P2PEngine() {
  auto& I = *impl_;
  {
    std::lock_guard<std::mutex> lock(I.mu);
    I.stopping = true;
  }
  // Tell every peer we are leaving (a zero-length header), then wake our receivers.
  for (int r = 0; r < I.size; ++r) {
    if (I.fds[r] < 0) continue;
    try {
      std::lock_guard<std::mutex> lock(*I.send_mu[r]);
      int64_t bye[kFixedWords] = {kMagic, 0};
      detail::write_all(I.fds[r], {iovec{bye, sizeof bye}});
    } catch (...) {
    }
    shutdown(I.fds[r], SHUT_RDWR);
  }
  for (auto& t : I.receivers) t.join();
  for (int fd : I.fds)
    if (fd >= 0) close(fd);
}

void P2PEngine::set_payload_group(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                  PayloadTransport transport, const std::string& device) {
  auto& I = *impl_;
  SMP_CHECK(transport == PayloadTransport::kTcp || group,
            "p2p: the c10d payload transport needs a process group");
  if (group)
    SMP_CHECK(group->getSize() == I.size && group->getRank() == I.rank, "p2p: payload group of ",
              group->getSize(), " ranks (rank ", group->getRank(), ") does not match the engine's ",
              I.size, " (rank ", I.rank, ")");
  std::lock_guard<std::mutex> lock(I.mu);
  I.payload_pg = std::move(group);
  I.transport = transport;
  I.device = at::Device(device);
  I.payload_set.notify_all();
}

int P2PEngine::rank() const { return impl_->rank; }
int P2PEngine::size() const { return impl_->size; }
double P2PEngine::timeout_s() const { return impl_->timeout_s; }

void P2PEngine::send(int dst, const Message& msg) {
  SMP_CHECK(dst >= 0 && dst < impl_->size, "p2p: destination ", dst, " outside pp group of ",
            impl_->size);
  if (dst == impl_->rank) {
    Message copy = msg;
    copy.src = impl_->rank;
    std::lock_guard<std::mutex> lock(impl_->mu);
    copy.epoch = impl_->epoch;
    impl_->deliver_locked(std::move(copy));
    return;
  }
  const int64_t n = static_cast<int64_t>(msg.tensors.size());
  const int64_t meta_len = static_cast<int64_t>(msg.meta.size());
  const int64_t rng_len = static_cast<int64_t>(msg.rng.size());
  SMP_CHECK(n <= kMaxTensors, "p2p: a message of ", n, " tensors (at most ", kMaxTensors, ")");
  std::vector<int64_t> head(kFixedWords + n * kWordsPerTensor, 0);
  std::vector<at::Tensor> tensors, by_c10d;
  int64_t total = static_cast<int64_t>(head.size()) * 8 + meta_len + rng_len;
  auto& I = *impl_;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& t = msg.tensors[i];
    SMP_CHECK(t.dim() <= kMaxDims, "p2p: tensor with ", t.dim(), " dims (at most ", kMaxDims, ")");
    const bool c10d_payload = I.by_c10d(t);
    if (!c10d_payload && !t.device().is_cpu())
      throw CommError(str_cat("smp: a ", t.device().str(), " tensor cannot cross the pipeline's TCP "
                              "transport (allowed: CPU tensors; set config 'p2p_transport' to "
                              "'auto' or 'c10d' for device tensors)"));
    int64_t* d = head.data() + kFixedWords + i * kWordsPerTensor;
    d[0] = static_cast<int64_t>(t.scalar_type()) | (c10d_payload ? kByC10d : 0) |
           (t.device().is_cuda() ? kOnCuda : 0);
    // Note [Layout travels]: a dense layout goes as it is; any other view contiguous.
    const at::Tensor dense = t.is_non_overlapping_and_dense() ? t : t.contiguous();
    (c10d_payload ? by_c10d : tensors).push_back(flat(dense));
    d[1] = t.dim();
    for (int64_t k = 0; k < t.dim(); ++k) d[2 + k] = dense.size(k);
    for (int64_t k = 0; k < t.dim(); ++k) d[2 + kMaxDims + k] = dense.stride(k);
    total += t.numel() * static_cast<int64_t>(t.element_size());
  }
  head[0] = kMagic, head[1] = total, head[2] = msg.mb, head[3] = msg.call_id, head[4] = msg.kind;
  head[5] = meta_len, head[6] = n, head[8] = rng_len, head[9] = msg.autocast;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    head[7] = impl_->epoch;
  }
  std::vector<iovec> iov;
  iov.push_back({head.data(), head.size() * 8});
  if (meta_len) iov.push_back({const_cast<char*>(msg.meta.data()), msg.meta.size()});
  if (rng_len) iov.push_back({const_cast<char*>(msg.rng.data()), msg.rng.size()});
  for (const at::Tensor& t : tensors)
    if (t.numel()) iov.push_back({t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size()});
  try {
    std::lock_guard<std::mutex> lock(*impl_->send_mu[dst]);
    detail::write_all(impl_->fds[dst], std::move(iov));
    for (auto& t : by_c10d) {  // in descriptor order, as the receiver posts its receives
      std::vector<at::Tensor> one{t};
      I.wait_payload(I.payload_pg->send(one, dst, kPayloadTag),
                     str_cat("pp rank ", dst, " to receive a pipeline tensor (c10d send)"));
    }
  } catch (const std::exception& e) {
    throw CommError(str_cat("smp: pipeline send to pp rank ", dst, " failed (microbatch ", msg.mb,
                            ", call ", msg.call_id, ", kind ", msg.kind, "): ", first_line(e.what())));
  }
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->stats.messages_sent++;
  impl_->stats.bytes_sent += total;
}

Message P2PEngine::recv(int64_t mb, int64_t call_id, uint32_t kind_mask, const std::string& what,
                        bool yield_token, int64_t priority, RecvOrder order, bool for_holder) {
  auto& I = *impl_;
  std::unique_lock<std::mutex> lock(I.mu);
  auto start = std::chrono::steady_clock::now();
  auto deadline = start + std::chrono::milliseconds(static_cast<int64_t>(I.timeout_s * 1000));
  // Note [Receive order]: rank of a message under `order` (smaller first; ties keep
  // arrival order). Step-level messages come first: an abort must not wait behind work.
  // The token's own rule (Note [Order without a list] in smp_core/plan.cpp), so token and
  // receive order agree.
  const PlanKind kind = order == RecvOrder::kBackwardFirst ? PlanKind::kInterleaved
                                                            : PlanKind::kSimple;
  auto rank_of = [&](const Message& m) -> int64_t {
    if (m.kind == kAbort || m.kind == kStepEnd || m.kind == kPlan) return -1;
    const bool backward = m.kind == kBackwardRequest || m.kind == kBackwardResponse;
    return order_priority(kind, m.mb, backward ? Phase::kBackward : Phase::kForward);
  };
  auto find = [&] {
    auto match = [&](const Message& m) { return I.matches(m, mb, call_id, kind_mask); };
    auto it = std::find_if(I.mailbox.begin(), I.mailbox.end(), match);
    if (order == RecvOrder::kArrival || it == I.mailbox.end()) return it;
    auto best = it;
    for (++it; it != I.mailbox.end(); ++it)
      if (match(*it) && rank_of(*it) < rank_of(*best)) best = it;
    return best;
  };
  // Step-level messages (an abort, the step's end) and a microbatch's end stay in the
  // mailbox until the next begin_step, so that every waiting task of the step sees
  // them, not only the first.
  auto take = [&](std::deque<Message>::iterator pos) {
    if (pos->kind == kAbort || pos->kind == kStepEnd || pos->kind == kMicrobatchDone ||
        pos->kind == kPlanOff)
      return Message(*pos);
    Message m = std::move(*pos);
    I.mailbox.erase(pos);
    return m;
  };
  auto it = find();
  if (it == I.mailbox.end()) {
    std::thread::id holder;
    TaskContext* holder_task = nullptr;
    if (yield_token && (I.holds_token_locked() || (for_holder && I.token_held))) {
      holder = I.token_owner;
      holder_task = I.token_task;
      I.token_owner = std::this_thread::get_id();  // released by this thread, for the holder
      I.release_locked();
    } else {
      yield_token = false;  // not holding it: nothing to give back
    }
    Impl::MailWaiter me{mb, call_id, kind_mask, {}};
    I.mail_waiters.push_back(&me);
    struct Unregister {
      Impl& I;
      Impl::MailWaiter* w;
      ~Unregister() { I.mail_waiters.erase(std::find(I.mail_waiters.begin(), I.mail_waiters.end(), w)); }
    } unregister{I, &me};
    while ((it = find()) == I.mailbox.end()) {
      // Note [Late messages after a peer left]: a peer that finished the job closes its
      // engine as soon as it has what it needs (the step's end), and this rank may see
      // that before its own copy of a message from another peer, on another socket. So
      // a wait that another peer's loss would end gets a short grace for it.
      auto until = deadline;
      if (!I.fatal.empty()) {
        const auto grace_end = I.fatal_since + kFatalGrace;
        if (std::chrono::steady_clock::now() >= grace_end)
          throw CommError(I.fatal + " while waiting for " + what);
        until = std::min(deadline, grace_end);
      }
      if (me.cv.wait_until(lock, until) == std::cv_status::timeout && find() == I.mailbox.end() &&
          until == deadline)
        throw TimeoutError(str_cat("smp: timed out after ", I.timeout_s, " s waiting for ", what,
                                   " (pp rank ", I.rank, ")"));
    }
    Message m = take(it);
    I.stats.wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (yield_token) {
      I.acquire_locked(lock, priority, holder_task);
      I.token_owner = holder;  // back to whoever held it
    }
    return m;
  }
  // Note [Planned token order]: the message was there already, but what the caller
  // does next is a new planned action: it waits for its turn all the same.
  if (yield_token && I.ordered && I.token_priority != priority &&
      (I.holds_token_locked() || (for_holder && I.token_held))) {
    Message m = take(it);
    const std::thread::id holder = I.token_owner;
    TaskContext* holder_task = I.token_task;
    I.token_owner = std::this_thread::get_id();
    I.release_locked();
    I.acquire_locked(lock, priority, holder_task);
    I.token_owner = holder;
    return m;
  }
  return take(it);
}

void P2PEngine::begin_step(int64_t epoch) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->unorder_locked();
  impl_->end_serial_locked();
  impl_->epoch = epoch;
  auto& box = impl_->mailbox;
  box.erase(std::remove_if(box.begin(), box.end(), [&](const Message& m) { return m.epoch < epoch; }),
            box.end());
  // Messages of this step that arrived early may now match someone already waiting.
  for (auto* w : impl_->mail_waiters)
    for (const auto& m : box)
      if (impl_->matches(m, w->mb, w->call_id, w->mask)) w->cv.notify_one();
}

P2PEngine::Stats P2PEngine::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->stats;
}

}  // namespace smp
