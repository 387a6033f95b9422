// The metadata of a remote call (smp_core/call_meta.h, Note [Call metadata]): the bytes
// of both layouts, round trips of the general case, and every malformed input a peer
// could send refused by name. No processes: these are the pure functions both sides use.
#include "smp_core/call_meta.h"

#include <gtest/gtest.h>

#include "smp_core/errors.h"

namespace smp {
namespace {

std::string u32(uint32_t n) {
  std::string s;
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return s;
}

std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int c : b) s.push_back(static_cast<char>(c));
  return s;
}

RequestMeta request(std::string skeleton = "") {
  RequestMeta m;
  m.module = "mid";
  m.grad = true;
  m.mode_flags = bytes({1, 0, 1});
  m.requires_grad = {true, false};
  m.skeleton = std::move(skeleton);
  return m;
}

// The fast layout is the general one without its skeleton field: the same fields in the
// same places, the layout byte 0 instead of 1.
TEST(CallMeta, FastAndGeneralRequestsShareTheirFieldsByteForByte) {
  const std::string fast = encode_request(request());
  const std::string fields = u32(2) + bytes({1, 0}) + u32(3) + "mid" + u32(3) + bytes({1, 0, 1});
  EXPECT_EQ(fast, "Q" + bytes({1, 0}) + fields);
  const std::string general = encode_request(request("SKEL"));
  EXPECT_EQ(general, "Q" + bytes({1, 1}) + fields + u32(4) + "SKEL");
  // One encoder: the same call encodes to the same bytes every time.
  EXPECT_EQ(encode_request(request()), fast);
}

TEST(CallMeta, RequestsRoundTripInBothLayouts) {
  for (const std::string& skeleton : {std::string(), std::string("\x80\x04(args, kwargs)", 16)}) {
    const RequestMeta in = request(skeleton);
    const RequestMeta out = decode_request(encode_request(in), 2, "a request");
    EXPECT_EQ(out.module, in.module);
    EXPECT_EQ(out.grad, in.grad);
    EXPECT_EQ(out.mode_flags, in.mode_flags);
    EXPECT_EQ(out.requires_grad, in.requires_grad);
    EXPECT_EQ(out.skeleton, in.skeleton);
  }
  // No tensors, no flags, no grad: a call of a module that takes none.
  RequestMeta empty;
  empty.module = "m";
  empty.skeleton = "S";
  const RequestMeta back = decode_request(encode_request(empty), 0, "a request");
  EXPECT_EQ(back.module, "m");
  EXPECT_TRUE(back.requires_grad.empty() && back.mode_flags.empty() && !back.grad);
}

TEST(CallMeta, AnswersRoundTripAndTheFastOneHasOneTensor) {
  const std::string one = encode_answer(AnswerMeta{{true}, ""});
  EXPECT_EQ(one, "A" + bytes({0}) + u32(1) + bytes({1}));
  EXPECT_EQ(decode_answer(one, 1, "x").requires_grad, std::vector<bool>{true});
  const AnswerMeta many{{false, true, true}, "OUTS"};
  const AnswerMeta back = decode_answer(encode_answer(many), 3, "x");
  EXPECT_EQ(back.requires_grad, many.requires_grad);
  EXPECT_EQ(back.skeleton, "OUTS");
  // A general answer of one tensor (a tuple of one) keeps its skeleton.
  EXPECT_EQ(decode_answer(encode_answer(AnswerMeta{{false}, "T1"}), 1, "x").skeleton, "T1");
  EXPECT_THROW(encode_answer(AnswerMeta{{true, true}, ""}), std::runtime_error);
}

void expect_refused(const std::string& meta, size_t n, const std::string& why,
                    bool answer = false) {
  try {
    if (answer)
      decode_answer(meta, n, "the output of 'mid'");
    else
      decode_request(meta, n, "the request of call 3");
    ADD_FAILURE() << "accepted: " << why;
  } catch (const CommError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("pipeline protocol error"), std::string::npos) << what;
    EXPECT_NE(what.find(why), std::string::npos) << what;
  }
}

TEST(CallMeta, MalformedBytesAreRefusedByName) {
  const std::string good = encode_request(request("SKEL"));
  expect_refused("", 2, "ends before its tag");
  expect_refused("A" + good.substr(1), 2, "not a request's");
  expect_refused(good, 3, "describes 2 tensors, the message carries 3");
  for (size_t cut = 1; cut < good.size(); ++cut)
    expect_refused(good.substr(0, cut), 2, "(" + std::to_string(cut) + " bytes)");
  expect_refused(good + "x", 2, "1 bytes follow its last field");
  std::string bad_flag = good;
  bad_flag[1] = 7;
  expect_refused(bad_flag, 2, "grad mode is 7 (allowed: 0, 1)");
  std::string bad_layout = good;
  bad_layout[2] = 2;
  expect_refused(bad_layout, 2, "layout is 2");
  std::string huge = good;
  huge.replace(3, 4, u32(0xffffffffu));  // the flags' count: more than is left
  expect_refused(huge, kAnyCount, "claims 4294967295 bytes");
  std::string bad_mode = encode_request(request());
  bad_mode.back() = 2;
  expect_refused(bad_mode, 2, "mode flag is neither 0 nor 1");
  expect_refused("Q" + bytes({1, 1}) + u32(0) + u32(1) + "m" + u32(0) + u32(0), 0,
                 "empty skeleton");
  expect_refused("A" + bytes({0}) + u32(2) + bytes({1, 1}), 2, "one tensor, always", true);
  expect_refused(good, 2, "not an answer's", true);
}

}  // namespace
}  // namespace smp
