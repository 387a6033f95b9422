#include "smp_core/call_meta.h"

#include <cstdint>

#include "smp_core/errors.h"

namespace smp {
namespace {

constexpr char kRequestTag = 'Q';
constexpr char kAnswerTag = 'A';
constexpr char kFast = 0;
constexpr char kGeneral = 1;

void put_u32(std::string& out, size_t n) {
  SMP_CHECK(n <= UINT32_MAX, "call metadata: a field of ", n, " bytes (at most 2^32 - 1)");
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
}

void put_bytes(std::string& out, const std::string& bytes) {
  put_u32(out, bytes.size());
  out += bytes;
}

void put_flags(std::string& out, const std::vector<bool>& flags) {
  put_u32(out, flags.size());
  for (bool f : flags) out.push_back(f ? 1 : 0);
}

// Reads Note [Call metadata]'s fields off a peer's bytes, each checked against what is
// left before it is taken.
class Reader {
 public:
  Reader(const std::string& bytes, const std::string& what) : s_(bytes), what_(what) {}

  [[noreturn]] void fail(const std::string& why) const {
    throw CommError(str_cat("smp: pipeline protocol error: ", what_, " has malformed call "
                            "metadata (", s_.size(), " bytes): ", why));
  }

  char byte(const char* field) {
    if (at_ >= s_.size()) fail(str_cat("it ends before its ", field));
    return s_[at_++];
  }

  bool flag(const char* field) {
    const char b = byte(field);
    if (b != 0 && b != 1)
      fail(str_cat("its ", field, " is ", static_cast<int>(static_cast<unsigned char>(b)),
                   " (allowed: 0, 1)"));
    return b == 1;
  }

  size_t length(const char* field) {
    if (s_.size() - at_ < 4) fail(str_cat("it ends inside the length of its ", field));
    size_t n = 0;
    for (int i = 0; i < 4; ++i) n |= size_t(static_cast<unsigned char>(s_[at_ + i])) << (8 * i);
    at_ += 4;
    if (n > s_.size() - at_)
      fail(str_cat("its ", field, " claims ", n, " bytes, ", s_.size() - at_, " are left"));
    return n;
  }

  std::string bytes(const char* field) {
    const size_t n = length(field);
    std::string out = s_.substr(at_, n);
    at_ += n;
    return out;
  }

  std::vector<bool> flags(const char* field) {
    const size_t n = length(field);
    std::vector<bool> out(n);
    for (size_t i = 0; i < n; ++i) out[i] = flag(field);
    return out;
  }

  void end() const {
    if (at_ != s_.size()) fail(str_cat(s_.size() - at_, " bytes follow its last field"));
  }

 private:
  const std::string& s_;
  const std::string& what_;
  size_t at_ = 0;
};

void check_count(const Reader& r, size_t got, size_t n_tensors) {
  if (n_tensors != kAnyCount && got != n_tensors)
    r.fail(str_cat("it describes ", got, " tensors, the message carries ", n_tensors));
}

bool layout(Reader& r) {
  const char l = r.byte("layout");
  if (l != kFast && l != kGeneral)
    r.fail(str_cat("its layout is ", static_cast<int>(static_cast<unsigned char>(l)),
                   " (allowed: 0 fast, 1 general)"));
  return l == kGeneral;
}

}  // namespace

std::string encode_request(const RequestMeta& meta) {
  std::string out;
  out.reserve(16 + meta.requires_grad.size() + meta.module.size() + meta.mode_flags.size() +
              meta.skeleton.size());
  out.push_back(kRequestTag);
  out.push_back(meta.grad ? 1 : 0);
  out.push_back(meta.skeleton.empty() ? kFast : kGeneral);
  put_flags(out, meta.requires_grad);
  put_bytes(out, meta.module);
  put_bytes(out, meta.mode_flags);
  if (!meta.skeleton.empty()) put_bytes(out, meta.skeleton);
  return out;
}

std::string encode_answer(const AnswerMeta& meta) {
  SMP_CHECK(!meta.skeleton.empty() || meta.requires_grad.size() == 1,
            "call metadata: an answer without a skeleton has one tensor, not ",
            meta.requires_grad.size());
  std::string out;
  out.reserve(8 + meta.requires_grad.size() + meta.skeleton.size());
  out.push_back(kAnswerTag);
  out.push_back(meta.skeleton.empty() ? kFast : kGeneral);
  put_flags(out, meta.requires_grad);
  if (!meta.skeleton.empty()) put_bytes(out, meta.skeleton);
  return out;
}

RequestMeta decode_request(const std::string& bytes, size_t n_tensors, const std::string& what) {
  Reader r(bytes, what);
  if (r.byte("tag") != kRequestTag) r.fail("it is not a request's (tag 'Q')");
  RequestMeta meta;
  meta.grad = r.flag("grad mode");
  const bool general = layout(r);
  meta.requires_grad = r.flags("requires-grad flag");
  check_count(r, meta.requires_grad.size(), n_tensors);
  meta.module = r.bytes("module name");
  meta.mode_flags = r.bytes("mode flags");
  for (char f : meta.mode_flags)
    if (f != 0 && f != 1) r.fail("a mode flag is neither 0 nor 1");
  if (general) {
    meta.skeleton = r.bytes("skeleton");
    if (meta.skeleton.empty()) r.fail("its general layout has an empty skeleton");
  }
  r.end();
  return meta;
}

AnswerMeta decode_answer(const std::string& bytes, size_t n_tensors, const std::string& what) {
  Reader r(bytes, what);
  if (r.byte("tag") != kAnswerTag) r.fail("it is not an answer's (tag 'A')");
  AnswerMeta meta;
  const bool general = layout(r);
  meta.requires_grad = r.flags("requires-grad flag");
  check_count(r, meta.requires_grad.size(), n_tensors);
  if (general) {
    meta.skeleton = r.bytes("skeleton");
    if (meta.skeleton.empty()) r.fail("its general layout has an empty skeleton");
  } else if (meta.requires_grad.size() != 1) {
    r.fail(str_cat("its fast layout describes ", meta.requires_grad.size(),
                   " tensors (one tensor, always)"));
  }
  r.end();
  return meta;
}

}  // namespace smp
