#include "hooks/powersgd.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <mutex>

#include "hooks/builtin.h"
#include "hooks/detail/collectives.h"
#include "hooks/detail/numpy_random.h"
#include "hooks/detail/powersgd_math.h"
#include "smp_core/errors.h"

namespace smp::hooks {

// torch draws each Q seed as rng.randint(1_000_000_000).
constexpr int64_t kSeedBound = 1000000000;

void validate(const PowerSGDOptions& o) {
  if (o.matrix_approximation_rank < 1)
    throw ConfigError(str_cat("smp: PowerSGDState matrix_approximation_rank=",
                              o.matrix_approximation_rank, " must be >= 1"));
  if ((o.use_error_feedback || o.warm_start) && o.start_powerSGD_iter <= 1)
    throw ConfigError(str_cat(
        "smp: PowerSGDState start_powerSGD_iter=", o.start_powerSGD_iter,
        " must be > 1 when use_error_feedback or warm_start is on (the buckets are rebuilt "
        "after the first step; state kept before that would not fit them)"));
  if (!(o.timeout_s > 0))
    throw ConfigError(str_cat("smp: PowerSGDState timeout_s=", o.timeout_s, " must be > 0"));
}

// One bucket between run() and result().
struct Pending {
  bool compressed = false;
  int world = 1;
  at::Tensor buffer;      // the bucket's buffer: what result() returns
  at::Tensor input;       // gets the result: the buffer, or its padded copy (batched)
  // What is compressed: `input` itself, or with error feedback input + last error,
  // computed into the error tensor's memory (torch's input_cp; no copy, no allocation)
  // and turned into the new error (source - result) in place.
  at::Tensor source;
  at::Tensor uncompressed;                  // summed flat copy of the uncompressed tensors
  std::vector<at::Tensor> uncompressed_tensors;  // views of `input` (destinations)
  std::vector<at::Tensor> matrices;         // [B, n, m] of `source` (views or stacks)
  std::vector<at::Tensor> outs;             // [B, n, m] views of `input`, or undefined
  std::vector<std::vector<at::Tensor>> stacked_into;  // stacks: the views of `input`
  std::vector<at::Tensor> ps, qs;           // [B, n, r], [B, m, r] views of p_mem, q_mem
  at::Tensor p_mem, q_mem;
};

struct PowerSGDState::Impl {
  mutable std::mutex mu;
  PowerSGDOptions opts;
  ProcessGroupPtr pg;
  detail::LegacyRandomState rng;
  int64_t iter = 0, before = 0, after = 0, next_report = 0, reports = 0;
  std::atomic<int64_t> bytes{0};
  std::map<int64_t, at::Tensor> error, p, q;
  std::map<size_t, std::shared_ptr<Pending>> pending;  // by bucket index

  ProcessGroupPtr group(const GradBucket& b) const { return pg ? pg : b.process_group(); }

  // torch's maybe_increase_iter, at the end of each bucket's run().
  void end_bucket(const GradBucket& b) {
    std::lock_guard<std::mutex> lock(mu);
    if (b.is_last()) ++iter;
  }
  // torch's _report_compression_stats, before the last bucket's iter increment.
  void maybe_report(const GradBucket& b) {
    if (b.is_last() && iter >= next_report) {
      ++reports;
      next_report = iter + std::max<int64_t>(1, opts.compression_stats_logging_frequency);
    }
  }
  FuturePtr allreduce(const ProcessGroupPtr& g, const at::Tensor& t) {
    bytes += t.numel() * static_cast<int64_t>(t.element_size());
    return detail::allreduce_sum(g, t);
  }
  void put_pending(size_t b, std::shared_ptr<Pending> p) {
    std::lock_guard<std::mutex> lock(mu);
    pending[b] = std::move(p);
  }
  std::shared_ptr<Pending> take_pending(const GradBucket& b, const std::string& hook) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = pending.find(b.index());
    SMP_CHECK(it != pending.end(), hook, ": result() without run() for bucket ", b.index());
    auto p = std::move(it->second);
    pending.erase(it);
    return p;
  }
  // Remembered tensor `key` of `dict` for bucket b, or undefined; checks its size.
  at::Tensor lookup(std::map<int64_t, at::Tensor>& dict, int64_t b, int64_t numel,
                    const char* key, const std::string& hook) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = dict.find(b);
    if (it == dict.end()) return at::Tensor();
    if (it->second.numel() != numel)
      throw ConfigError(str_cat("smp: ", hook, ": the state's ", key, "[", b, "] holds ",
                                it->second.numel(), " elements but bucket ", b, " needs ",
                                numel, " (state from a different model or bucket layout)"));
    return it->second;
  }
  void store(std::map<int64_t, at::Tensor>& dict, int64_t b, at::Tensor t) {
    std::lock_guard<std::mutex> lock(mu);
    dict[b] = std::move(t);
  }
};

PowerSGDState::PowerSGDState(PowerSGDOptions options, ProcessGroupPtr pg)
    : impl_(std::make_unique<Impl>()) {
  validate(options);
  impl_->opts = options;
  impl_->pg = std::move(pg);
  impl_->rng = detail::LegacyRandomState(options.random_seed);
}

PowerSGDState::~PowerSGDState() = default;

const PowerSGDOptions& PowerSGDState::options() const { return impl_->opts; }
const ProcessGroupPtr& PowerSGDState::process_group() const { return impl_->pg; }
void PowerSGDState::set_process_group(ProcessGroupPtr pg) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->pg = std::move(pg);
}
void PowerSGDState::set_timeout(double timeout_s) {
  PowerSGDOptions o = impl_->opts;
  o.timeout_s = timeout_s;
  validate(o);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->opts.timeout_s = timeout_s;
}

int64_t PowerSGDState::iter() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->iter;
}

std::tuple<double, int64_t, int64_t> PowerSGDState::compression_stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  double rate = impl_->after > 0 ? static_cast<double>(impl_->before) / impl_->after : 0.0;
  return {rate, impl_->before, impl_->after};
}

int64_t PowerSGDState::bytes_allreduced() const { return impl_->bytes.load(); }

int64_t PowerSGDState::stats_reports() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->reports;
}

PowerSGDSnapshot PowerSGDState::snapshot() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  PowerSGDSnapshot s;
  s.options = impl_->opts;
  s.rng_key = impl_->rng.key();
  s.rng_pos = impl_->rng.pos();
  s.iter = impl_->iter;
  s.total_numel_before_compression = impl_->before;
  s.total_numel_after_compression = impl_->after;
  s.next_stats_report = impl_->next_report;
  s.error_dict = impl_->error;
  s.p_memory_dict = impl_->p;
  s.q_memory_dict = impl_->q;
  return s;
}

void PowerSGDState::restore(const PowerSGDSnapshot& s) {
  validate(s.options);
  detail::LegacyRandomState rng;
  rng.set_state(s.rng_key, s.rng_pos);
  std::lock_guard<std::mutex> lock(impl_->mu);
  impl_->opts = s.options;
  impl_->rng = rng;
  impl_->iter = s.iter;
  impl_->before = s.total_numel_before_compression;
  impl_->after = s.total_numel_after_compression;
  impl_->next_report = s.next_stats_report;
  // Copies: the hooks update these tensors in place.
  auto copy = [](const std::map<int64_t, at::Tensor>& m) {
    std::map<int64_t, at::Tensor> out;
    for (const auto& [k, t] : m) out[k] = t.clone();
    return out;
  };
  impl_->error = copy(s.error_dict);
  impl_->p = copy(s.p_memory_dict);
  impl_->q = copy(s.q_memory_dict);
  impl_->pending.clear();
}

namespace {

// The part both hooks share: checks, the vanilla phase, and the completion future.
class PowerSGDBase : public CommHook {
 public:
  explicit PowerSGDBase(PowerSGDStatePtr state) : state_(std::move(state)) {
    if (!state_) throw ConfigError("smp: PowerSGD hook: the state is null");
  }
  bool issues_all_in_run() const override { return true; }

  FuturePtr run(GradBucket& bucket) override {
    auto& s = state_->impl();
    const at::Tensor& buf = bucket.buffer();
    if (!at::isFloatingType(buf.scalar_type()))
      throw ConfigError(str_cat("smp: ", name(), "_hook: bucket ", bucket.index(), " holds ",
                                buf.scalar_type(), " gradients; PowerSGD compresses only "
                                "floating-point gradients (float32, float64, float16, bfloat16)"));
    ProcessGroupPtr pg = s.group(bucket);
    auto p = std::make_shared<Pending>();
    p->buffer = buf;
    p->world = pg->getSize();
    bool vanilla;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      vanilla = s.iter < s.opts.start_powerSGD_iter;
    }
    FuturePtr done;
    if (vanilla) {
      // torch's default allreduce: divide first, then sum.
      buf.div_(p->world);
      done = s.allreduce(pg, buf);
    } else {
      p->compressed = true;
      done = compress(bucket, pg, *p);
    }
    s.put_pending(bucket.index(), p);
    s.end_bucket(bucket);
    return done->then(
        [buf](c10::ivalue::Future& f) -> c10::IValue {
          if (f.hasError()) std::rethrow_exception(f.exception_ptr());
          return buf;
        },
        c10::TensorType::get());
  }

  at::Tensor result(GradBucket& bucket, const c10::IValue&) override {
    auto p = state_->impl().take_pending(bucket, name());
    if (p->compressed) decompress(bucket, *p);
    return p->buffer;
  }

 protected:
  // Issues the bucket's collectives in their fixed order; returns the future of the last.
  virtual FuturePtr compress(GradBucket& bucket, const ProcessGroupPtr& pg, Pending& p) = 0;
  virtual void decompress(GradBucket& bucket, Pending& p) = 0;

  // Sets p.source: p.input, or with error feedback p.input + the remembered error,
  // written over the error tensor (the first time: a copy of p.input, as torch adds
  // zeros).
  void add_error(int64_t b, Pending& p) {
    auto& s = state_->impl();
    if (!s.opts.use_error_feedback) {
      p.source = p.input;
      return;
    }
    at::Tensor err = s.lookup(s.error, b, p.input.numel(), "error_dict", name());
    if (err.defined()) {
      at::add_out(err, p.input, err);
    } else {
      err = p.input.clone();
      s.store(s.error, b, err);
    }
    p.source = err;
  }
  // The new error, source - result, in place of the source.
  void keep_error(Pending& p) {
    if (state_->impl().opts.use_error_feedback) p.source.sub_(p.input);
  }

  // All-reduces P, waits (run() may wait: we are on the comm thread), orthogonalises
  // it, computes Q = M^T P and issues Q's allreduce.
  FuturePtr p_then_q(GradBucket& bucket, const ProcessGroupPtr& pg, Pending& p) {
    auto& s = state_->impl();
    FuturePtr fp = s.allreduce(pg, p.p_mem);
    wait_future(fp, s.opts.timeout_s,
                str_cat("the P allreduce of bucket ", bucket.index(), " (comm hook '", name(),
                        "') on ", pg->getBackendName(), " rank ", pg->getRank(), " of ",
                        pg->getSize()));
    for (const auto& ps : p.ps) detail::orthogonalize(ps, s.opts.orthogonalization_epsilon);
    for (size_t i = 0; i < p.matrices.size(); ++i)
      detail::bmm_into(p.qs[i], p.matrices[i].transpose(1, 2), p.ps[i]);
    return s.allreduce(pg, p.q_mem);
  }

  // Fresh Qs from one seed drawn from the state's RandomState (torch's fork_rng +
  // manual_seed(rng.randint(1e9)) + randn per Q).
  void randomize(const std::vector<at::Tensor>& qs) {
    auto& s = state_->impl();
    int64_t seed;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      seed = s.rng.randint(kSeedBound);
    }
    at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(seed));
    for (const auto& q : qs) {
      q.copy_(at::randn(q.sizes(), gen, at::TensorOptions().dtype(q.scalar_type())));
      detail::orthogonalize(q, s.opts.orthogonalization_epsilon);
    }
  }

  PowerSGDStatePtr state_;
};

class PowerSGDHook : public PowerSGDBase {
 public:
  using PowerSGDBase::PowerSGDBase;
  std::string name() const override { return builtin_hook_name(BuiltinCommHookType::kPowerSGD); }

 protected:
  FuturePtr compress(GradBucket& bucket, const ProcessGroupPtr& pg, Pending& p) override {
    auto& s = state_->impl();
    const auto& o = s.opts;
    const int64_t b = static_cast<int64_t>(bucket.index());
    p.input = p.buffer;
    add_error(b, p);

    // Split into compressed matrices and the uncompressed rest; count both.
    std::vector<std::pair<at::Tensor, at::Tensor>> to_compress;  // (of source, of input)
    std::vector<at::Tensor> flat;  // uncompressed parts of the source
    int64_t p_size = 0, q_size = 0;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      const auto& params = bucket.parameters();
      for (size_t j = 0; j < params.size(); ++j) {
        const at::Tensor& prm = params[j];
        const int64_t n = prm.dim() == 0 ? 1 : prm.size(0);
        const int64_t m = n == 0 ? 0 : prm.numel() / n;
        const int64_t off = bucket.offsets()[j];
        at::Tensor src = p.source.narrow(0, off, prm.numel());
        at::Tensor dst = p.input.narrow(0, off, prm.numel());
        const int64_t r = std::min({n, m, o.matrix_approximation_rank});
        s.before += n * m;
        if (detail::should_compress(n, m, r, o.min_compression_rate)) {
          to_compress.emplace_back(src.view({n, m}), dst.view({n, m}));
          p_size += n * r;
          q_size += m * r;
          s.after += (n + m) * r;
        } else {
          flat.push_back(src);
          p.uncompressed_tensors.push_back(dst);
          s.after += n * m;
        }
      }
      s.maybe_report(bucket);
    }
    p.uncompressed = flat.empty() ? at::empty({0}, p.buffer.options()) : at::cat(flat);

    at::Tensor pm = o.warm_start ? s.lookup(s.p, b, p_size, "p_memory_dict", name()) : at::Tensor();
    at::Tensor qm = o.warm_start ? s.lookup(s.q, b, q_size, "q_memory_dict", name()) : at::Tensor();
    const bool fresh = !pm.defined() || !qm.defined();
    if (fresh) {
      pm = at::empty({p_size}, p.buffer.options());
      qm = at::empty({q_size}, p.buffer.options());
    }
    p.p_mem = pm;
    p.q_mem = qm;

    // Group by shape in order of first appearance (torch's dict of shape -> tensors);
    // this order lays out P and Q and orders the random draws.
    using Pair = std::pair<at::Tensor, at::Tensor>;
    std::vector<std::pair<std::vector<int64_t>, std::vector<Pair>>> groups;
    for (const auto& mat : to_compress) {
      std::vector<int64_t> shape = mat.first.sizes().vec();
      auto it = std::find_if(groups.begin(), groups.end(),
                             [&](const auto& g) { return g.first == shape; });
      if (it == groups.end()) groups.push_back({shape, {mat}});
      else it->second.push_back(mat);
    }
    int64_t pi = 0, qi = 0;
    auto add = [&](at::Tensor batch, at::Tensor out, std::vector<at::Tensor> into) {
      const int64_t bs = batch.size(0), n = batch.size(1), m = batch.size(2);
      const int64_t r = std::min({n, m, o.matrix_approximation_rank});
      p.matrices.push_back(batch);
      p.outs.push_back(std::move(out));
      p.stacked_into.push_back(std::move(into));
      p.ps.push_back(pm.narrow(0, pi, bs * n * r).view({bs, n, r}));
      p.qs.push_back(qm.narrow(0, qi, bs * m * r).view({bs, m, r}));
      pi += bs * n * r;
      qi += bs * m * r;
    };
    for (auto& g : groups) {
      if (o.batch_tensors_with_same_shape && g.second.size() > 1) {
        std::vector<at::Tensor> srcs, dsts;
        for (const auto& [src, dst] : g.second) {
          srcs.push_back(src);
          dsts.push_back(dst);
        }
        add(at::stack(srcs), at::Tensor(), std::move(dsts));
      } else {
        for (const auto& [src, dst] : g.second) add(src.unsqueeze(0), dst.unsqueeze(0), {});
      }
    }

    if (fresh)
      randomize(p.qs);
    else
      for (const auto& q : p.qs) detail::orthogonalize(q, o.orthogonalization_epsilon);
    for (size_t i = 0; i < p.matrices.size(); ++i)
      detail::bmm_into(p.ps[i], p.matrices[i], p.qs[i]);

    // See Note [Ordered bucket communication]: rest, P, Q, all from this thread.
    FuturePtr fu = s.allreduce(pg, p.uncompressed);
    FuturePtr fq = p_then_q(bucket, pg, p);
    c10::List<FuturePtr> both(c10::FutureType::create(c10::TensorType::get()));
    both.push_back(fu);
    both.push_back(fq);
    return c10::collectAll(both)->then(
        [fu, fq](c10::ivalue::Future& all) -> c10::IValue {
          if (all.hasError()) std::rethrow_exception(all.exception_ptr());
          if (fu->hasError()) std::rethrow_exception(fu->exception_ptr());
          if (fq->hasError()) std::rethrow_exception(fq->exception_ptr());
          return fq->value();
        },
        fq->elementType());
  }

  void decompress(GradBucket& bucket, Pending& p) override {
    auto& s = state_->impl();
    const auto& o = s.opts;
    const int64_t b = static_cast<int64_t>(bucket.index());
    p.uncompressed.div_(p.world);
    int64_t off = 0;
    for (auto& t : p.uncompressed_tensors) {
      t.copy_(p.uncompressed.narrow(0, off, t.numel()).view_as(t));
      off += t.numel();
    }
    p.q_mem.div_(p.world);
    for (size_t i = 0; i < p.matrices.size(); ++i) {
      // A stack is decompressed in place, then copied to its tensors (torch's order).
      const at::Tensor& out = p.outs[i].defined() ? p.outs[i] : p.matrices[i];
      detail::bmm_into(out, p.ps[i], p.qs[i].transpose(1, 2));
      const auto& into = p.stacked_into[i];
      for (size_t k = 0; k < into.size(); ++k) into[k].copy_(p.matrices[i][k]);
    }
    keep_error(p);
    if (o.warm_start) {
      s.store(s.p, b, p.p_mem);
      s.store(s.q, b, p.q_mem);
    }
  }
};

class BatchedPowerSGDHook : public PowerSGDBase {
 public:
  using PowerSGDBase::PowerSGDBase;
  std::string name() const override {
    return builtin_hook_name(BuiltinCommHookType::kBatchedPowerSGD);
  }

 protected:
  FuturePtr compress(GradBucket& bucket, const ProcessGroupPtr& pg, Pending& p) override {
    auto& s = state_->impl();
    const auto& o = s.opts;
    const int64_t b = static_cast<int64_t>(bucket.index());
    const int64_t total = p.buffer.numel();
    int64_t side = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(total))));
    while (side > 0 && (side - 1) * (side - 1) >= total) --side;  // exact ceil(sqrt)
    while (side * side < total) ++side;
    // torch's batched hook uses the rank as given; a rank above the side cannot be
    // orthonormal, so it is capped.
    const int64_t r = std::max<int64_t>(1, std::min(o.matrix_approximation_rank, side));
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.before += total;
      s.after += side * r * 2;
      s.maybe_report(bucket);
    }
    // torch resizes the bucket in place and pads with zeros; we pad a copy, so the
    // reducer's buffer keeps its size.
    p.input = at::zeros({side * side}, p.buffer.options());
    p.input.narrow(0, 0, total).copy_(p.buffer.reshape({-1}));
    add_error(b, p);
    p.matrices.push_back(p.source.view({1, side, side}));
    p.outs.push_back(p.input.view({1, side, side}));
    p.stacked_into.emplace_back();

    at::Tensor pm = o.warm_start ? s.lookup(s.p, b, side * r, "p_memory_dict", name()) : at::Tensor();
    at::Tensor qm = o.warm_start ? s.lookup(s.q, b, side * r, "q_memory_dict", name()) : at::Tensor();
    const bool fresh = !pm.defined() || !qm.defined();
    if (fresh) {
      pm = at::empty({side, r}, p.buffer.options());
      qm = at::empty({side, r}, p.buffer.options());
    }
    p.p_mem = pm;
    p.q_mem = qm;
    p.ps.push_back(pm.view({1, side, r}));
    p.qs.push_back(qm.view({1, side, r}));
    if (fresh) {
      randomize(p.qs);  // orthogonalises too
    } else {
      detail::orthogonalize(p.qs[0], o.orthogonalization_epsilon);
    }
    detail::bmm_into(p.ps[0], p.matrices[0], p.qs[0]);
    return p_then_q(bucket, pg, p);
  }

  void decompress(GradBucket& bucket, Pending& p) override {
    auto& s = state_->impl();
    const int64_t b = static_cast<int64_t>(bucket.index());
    p.q_mem.div_(p.world);
    detail::bmm_into(p.outs[0], p.ps[0], p.qs[0].transpose(1, 2));
    keep_error(p);
    p.buffer.copy_(p.input.narrow(0, 0, p.buffer.numel()).view_as(p.buffer));
    if (s.opts.warm_start) {
      s.store(s.p, b, p.p_mem);
      s.store(s.q, b, p.q_mem);
    }
  }
};

}  // namespace

CommHookPtr powersgd_hook(PowerSGDStatePtr state) {
  return std::make_shared<PowerSGDHook>(std::move(state));
}

CommHookPtr batched_powersgd_hook(PowerSGDStatePtr state) {
  return std::make_shared<BatchedPowerSGDHook>(std::move(state));
}

}  // namespace smp::hooks
