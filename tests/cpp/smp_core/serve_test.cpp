// Serving a request (smp_core/serve.h, Note [Known forward requests]) with C++ hooks in
// the place of Python's: the leaves and grad mode the module gets, the answer's bytes
// in both layouts (the one encoder's), known requests' flags, and every failure
// answered as an error. The Server alone: serve() is a function of the request (the calls'
// graphs are kept by a Dispatcher only when one is attached: call_test.cpp).
#include "smp_core/serve.h"

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>

#include "smp_core/call_meta.h"
#include "smp_core/compat/torch_compat.h"
#include "smp_core/errors.h"

namespace smp {
namespace {

Message request(const RequestMeta& meta, std::vector<at::Tensor> tensors, int64_t mb = 0) {
  Message m;
  m.src = 0;
  m.mb = mb;
  m.call_id = 5;
  m.kind = kRequest;
  m.meta = encode_request(meta);
  m.tensors = std::move(tensors);
  return m;
}

RequestMeta meta_of(std::vector<bool> requires_grad, bool grad, std::string skeleton = "") {
  RequestMeta m;
  m.module = "layer";
  m.grad = grad;
  m.mode_flags = std::string(1, '\1');
  m.requires_grad = std::move(requires_grad);
  m.skeleton = std::move(skeleton);
  return m;
}

// What the hooks saw, per run.
struct Seen {
  std::string module, skeleton;
  int64_t mb = -1;
  bool flags = false;  // mode flags were passed (not known)
  bool grad_mode = false;
  std::vector<at::Tensor> args;
};

// A module `layer` returning x * 2 (positional) or, with a skeleton, (x * 2, x * 3).
struct Hooks {
  std::vector<Seen> seen;
  bool change_modes = false;
  bool fail = false;
  std::vector<std::pair<int64_t, bool>> failures;  // (mb, backward)

  ServeHooks make() {
    ServeHooks h;
    h.run = [this](const ModuleCall& call) {
      seen.push_back({call.module, call.skeleton, call.mb, call.mode_flags != nullptr,
                      at::GradMode::is_enabled(), call.args});
      if (fail) throw std::invalid_argument("the module raised");
      ModuleResult r;
      r.modes_changed = change_modes && call.mode_flags;
      r.outputs.push_back(call.args.at(0) * 2);
      if (!call.skeleton.empty()) {
        r.outputs.push_back(call.args.at(0) * 3);
        r.skeleton = "OUT:" + call.skeleton;
      }
      return r;
    };
    h.encode_failure = [this](std::exception_ptr e, int64_t mb, bool backward) {
      failures.emplace_back(mb, backward);
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& err) {
        return std::string("encoded: ") + err.what();
      }
    };
    return h;
  }
};

TEST(Serve, FastRequestGetsLeavesAsFlaggedAndAnswersInTheOneEncoding) {
  Hooks hooks;
  Server server(hooks.make(), 1);
  const at::Tensor x = at::ones({3}), y = at::zeros({2});
  const Message answer = server.serve(request(meta_of({true, false}, true), {x, y}, 4));
  ASSERT_EQ(answer.kind, kResponse) << answer.meta;
  EXPECT_EQ(answer.mb, 4);
  EXPECT_EQ(answer.call_id, 5);
  ASSERT_EQ(hooks.seen.size(), 1u);
  const Seen& s = hooks.seen[0];
  EXPECT_EQ(s.module, "layer");
  EXPECT_EQ(s.mb, 4);
  EXPECT_TRUE(s.flags);
  EXPECT_TRUE(s.grad_mode);
  EXPECT_TRUE(s.skeleton.empty());
  ASSERT_EQ(s.args.size(), 2u);
  EXPECT_TRUE(s.args[0].requires_grad() && s.args[0].is_leaf());
  EXPECT_FALSE(s.args[1].requires_grad());
  // The output required grad; it travels detached, its flag in the answer's bytes.
  EXPECT_EQ(answer.meta, encode_answer(AnswerMeta{{true}, ""}));
  ASSERT_EQ(answer.tensors.size(), 1u);
  EXPECT_FALSE(answer.tensors[0].requires_grad());
  EXPECT_TRUE(answer.tensors[0].equal(at::full({3}, 2.f)));
}

TEST(Serve, WithoutGradModeNothingRequiresGrad) {
  Hooks hooks;
  Server server(hooks.make(), 1);
  const Message answer = server.serve(request(meta_of({true}, false), {at::ones({2})}));
  ASSERT_EQ(answer.kind, kResponse);
  EXPECT_FALSE(hooks.seen.at(0).grad_mode);
  EXPECT_FALSE(hooks.seen.at(0).args.at(0).requires_grad());
  EXPECT_EQ(answer.meta, encode_answer(AnswerMeta{{false}, ""}));
}

TEST(Serve, GeneralRequestPassesItsSkeletonAndAnswersWithOne) {
  Hooks hooks;
  Server server(hooks.make(), 1);
  const Message answer = server.serve(request(meta_of({true}, true, "ARGS"), {at::ones({2})}));
  ASSERT_EQ(answer.kind, kResponse) << answer.meta;
  EXPECT_EQ(hooks.seen.at(0).skeleton, "ARGS");
  EXPECT_EQ(answer.meta, encode_answer(AnswerMeta{{true, true}, "OUT:ARGS"}));
  EXPECT_EQ(answer.tensors.size(), 2u);
}

// Note [Known forward requests]: flags are passed for the first request of given
// metadata in a step, not its repeats; a step, or a run that switched a mode, forgets
// them all.
TEST(Serve, KnownRequestsSkipTheirFlagsUntilAStepOrAModeSwitch) {
  Hooks hooks;
  Server server(hooks.make(), 1);
  const RequestMeta a = meta_of({true}, true), b = meta_of({false}, true);
  for (int mb = 0; mb < 3; ++mb) server.serve(request(a, {at::ones({1})}, mb));
  server.serve(request(b, {at::ones({1})}));
  ASSERT_EQ(hooks.seen.size(), 4u);
  EXPECT_TRUE(hooks.seen[0].flags);
  EXPECT_FALSE(hooks.seen[1].flags);
  EXPECT_FALSE(hooks.seen[2].flags);
  EXPECT_TRUE(hooks.seen[3].flags);
  EXPECT_EQ(server.served(), 2);
  EXPECT_EQ(server.known(), 2u);
  server.begin_step();
  EXPECT_EQ(server.known(), 0u);
  server.serve(request(a, {at::ones({1})}));
  EXPECT_TRUE(hooks.seen[4].flags);
  // b's run switches a mode: a must apply its flags again.
  hooks.change_modes = true;
  server.serve(request(b, {at::ones({1})}));
  EXPECT_EQ(server.known(), 1u);
  server.serve(request(a, {at::ones({1})}));
  EXPECT_TRUE(hooks.seen[6].flags);
  EXPECT_EQ(server.served(), 2);
}

TEST(Serve, FailuresAreErrorAnswersNamedByTheEncoder) {
  Hooks hooks;
  Server server(hooks.make(), 1);
  hooks.fail = true;
  Message err = server.serve(request(meta_of({false}, true), {at::ones({1})}, 2));
  EXPECT_EQ(err.kind, kError);
  EXPECT_EQ(err.mb, 2);
  EXPECT_EQ(err.call_id, 5);
  EXPECT_EQ(err.meta, "encoded: the module raised");
  hooks.fail = false;
  // Malformed metadata: the caller gets the protocol error.
  Message bad = request(meta_of({false}, true), {at::ones({1})});
  bad.meta = "Q";
  err = server.serve(bad);
  EXPECT_EQ(err.kind, kError);
  EXPECT_NE(err.meta.find("pipeline protocol error"), std::string::npos) << err.meta;
  // A backward request whose forward kept no graph here.
  Message backward = request(meta_of({false}, true), {at::ones({1})}, 3);
  backward.kind = kBackwardRequest;
  err = server.serve(backward);
  EXPECT_EQ(err.kind, kError);
  EXPECT_NE(err.meta.find("pp rank 1 got the backward of call 5 (microbatch 3) from pp rank 0"),
            std::string::npos) << err.meta;
  EXPECT_EQ(hooks.failures,
            (std::vector<std::pair<int64_t, bool>>{{2, false}, {0, false}, {3, true}}));
  EXPECT_EQ(hooks.seen.size(), 1u);  // neither malformed request reached the module
  EXPECT_EQ(server.known(), 0u);     // nor did the failed one become known
}

// Note [Received inputs are not weights]: under autocast a float32 leaf that requires
// grad reaches the module as a view; the leaf itself is what is kept for the backward.
TEST(Serve, UnderAutocastTheModuleGetsViewsOfFloatLeaves) {
  Hooks hooks;
  Server server(hooks.make(), 1);
  compat::set_autocast_enabled(c10::DeviceType::CPU, true);
  at::autocast::increment_nesting();
  server.serve(request(meta_of({true, true, false}, true),
                       {at::ones({2}), at::ones({2}, at::kDouble), at::ones({2})}));
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  compat::set_autocast_enabled(c10::DeviceType::CPU, false);
  const auto& args = hooks.seen.at(0).args;
  EXPECT_TRUE(args[0].is_view() && args[0].requires_grad());
  EXPECT_FALSE(args[1].is_view());  // float64: not autocast's
  EXPECT_FALSE(args[2].is_view());  // no grad: nothing to cache
}

}  // namespace
}  // namespace smp
