#include "smp_common/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "smp_common/env.h"

namespace smp::auth {
namespace {

constexpr char kHandshakeMagic[4] = {'S', 'M', 'P', 'A'};

std::mutex key_mu;
Key the_key{};
bool key_set = false;
bool key_from_env = false;

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

using Clock = std::chrono::steady_clock;

// Waits for `events` on `fd` until `deadline`; false when it passed.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, static_cast<int>(left));
    if (r > 0) return true;
    if (r < 0 && errno != EINTR) return false;
  }
}

// Exact reads and writes on a blocking or non-blocking socket, bounded by `deadline`.
// They return "" or what went wrong.
std::string write_bytes(int fd, const std::string& data, Clock::time_point deadline) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t w = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      done += static_cast<size_t>(w);
    } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      if (!wait_fd(fd, POLLOUT, deadline)) return "timed out sending the handshake";
    } else {
      return std::string("send failed: ") + std::strerror(errno);
    }
  }
  return "";
}

std::string read_bytes(int fd, std::string& out, size_t n, Clock::time_point deadline) {
  out.assign(n, '\0');
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::recv(fd, out.data() + done, n - done, MSG_DONTWAIT);
    if (r > 0) {
      done += static_cast<size_t>(r);
    } else if (r == 0) {
      return "the peer closed the connection during the handshake";
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      if (!wait_fd(fd, POLLIN, deadline)) return "timed out waiting for the peer's handshake";
    } else {
      return std::string("recv failed: ") + std::strerror(errno);
    }
  }
  return "";
}

Clock::time_point deadline_after(double timeout_s) {
  return Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
}

std::string transcript(const std::string& context, const std::string& nonce_i,
                       const std::string& nonce_r) {
  return context + '\0' + nonce_i + nonce_r;
}

}  // namespace

std::string random_bytes(size_t n) {
  std::string out(n, '\0');
  size_t done = 0;
  while (done < n) {
    const ssize_t r = ::getrandom(out.data() + done, n - done, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw std::runtime_error(std::string("smp: getrandom failed: ") + std::strerror(errno));
    done += static_cast<size_t>(r);
  }
  return out;
}

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    out.push_back(digits[c >> 4]);
    out.push_back(digits[c & 15]);
  }
  return out;
}

Key key_from_secret(const std::string& text, const std::string& where) {
  const std::string hex = common::trim(text);
  if (hex.size() < 32 || hex.size() % 2 != 0)
    throw std::invalid_argument("smp: " + where + " must be an even number of hex digits, at least 32 (got " +
                                std::to_string(hex.size()) + " characters); e.g. `openssl rand -hex 32`");
  std::string raw;
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = hex_digit(hex[i]), lo = hex_digit(hex[i + 1]);
    if (hi < 0 || lo < 0)
      throw std::invalid_argument("smp: " + where + " holds a character that is not a hex digit (at " +
                                  std::to_string(i) + "); allowed: 0-9, a-f");
    raw.push_back(static_cast<char>(hi * 16 + lo));
  }
  // Hashed, so that a secret of any length gives a full-size key.
  Key key{};
  unsigned int len = 0;
  if (!EVP_Digest(raw.data(), raw.size(), key.data(), &len, EVP_sha256(), nullptr) || len != kKeyBytes)
    throw std::runtime_error("smp: SHA-256 failed");
  OPENSSL_cleanse(raw.data(), raw.size());
  return key;
}

std::string secret_from_file(const std::string& path, const std::string& where) {
  std::ifstream in(path);
  if (!in)
    throw std::invalid_argument("smp: " + where + " '" + path + "' cannot be read: " +
                                std::strerror(errno));
  std::stringstream text;
  text << in.rdbuf();
  const std::string secret = common::trim(text.str());
  key_from_secret(secret, where + " '" + path + "'");  // validates
  return secret;
}

std::string secret_from_env() {
  const char* value = std::getenv(kSecretEnv);
  if (value && *value) {
    key_from_secret(value, kSecretEnv);  // validates
    return value;
  }
  const char* file = std::getenv(kSecretFileEnv);
  return file && *file ? secret_from_file(file, kSecretFileEnv) : "";
}

std::string mac(const Key& key, const std::string& label, const std::string& data) {
  std::string msg = label;
  msg.push_back('\0');
  msg += data;
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
            reinterpret_cast<const unsigned char*>(msg.data()), msg.size(), out, &len) ||
      len != kMacBytes)
    throw std::runtime_error("smp: HMAC-SHA256 failed");
  return std::string(reinterpret_cast<const char*>(out), len);
}

bool verify(const Key& key, const std::string& label, const std::string& data,
            const std::string& tag) {
  if (tag.size() != kMacBytes) return false;
  const std::string expected = mac(key, label, data);
  return CRYPTO_memcmp(expected.data(), tag.data(), kMacBytes) == 0;
}

void set_job_key(const Key& key, bool from_environment) {
  std::lock_guard<std::mutex> lock(key_mu);
  the_key = key;
  key_set = true;
  key_from_env = from_environment;
}

bool job_key_from_environment() {
  std::lock_guard<std::mutex> lock(key_mu);
  return key_from_env;
}

bool has_job_key() {
  std::lock_guard<std::mutex> lock(key_mu);
  return key_set;
}

const Key& job_key() {
  std::lock_guard<std::mutex> lock(key_mu);
  if (!key_set) throw std::logic_error("smp: the job key is used before smp.init set it");
  return the_key;
}

std::string seal(const std::string& store_key, const std::string& value) {
  return value + mac(job_key(), "store:" + store_key, value);
}

std::string unseal(const std::string& store_key, const std::string& sealed) {
  if (sealed.size() < kMacBytes ||
      !verify(job_key(), "store:" + store_key, sealed.substr(0, sealed.size() - kMacBytes),
              sealed.substr(sealed.size() - kMacBytes)))
    throw std::runtime_error("smp: the store value '" + store_key +
                             "' failed authentication (written by a process without this job's "
                             "secret, SMP_JOB_SECRET): refused");
  return sealed.substr(0, sealed.size() - kMacBytes);
}

std::string handshake_initiate(int fd, const Key& key, const std::string& label,
                               const std::string& context, double timeout_s) {
  const auto deadline = deadline_after(timeout_s);
  const std::string nonce_i = random_bytes(kNonceBytes);
  std::string err = write_bytes(fd, std::string(kHandshakeMagic, 4) + nonce_i, deadline);
  if (!err.empty()) return err;
  std::string reply;
  err = read_bytes(fd, reply, kNonceBytes + kMacBytes, deadline);
  if (!err.empty()) return err;
  const std::string nonce_r = reply.substr(0, kNonceBytes);
  if (!verify(key, label + "/responder", transcript(context, nonce_i, nonce_r),
              reply.substr(kNonceBytes)))
    return "the peer did not prove this job's secret (SMP_JOB_SECRET differs, or not one of "
           "this job's processes)";
  return write_bytes(fd, mac(key, label + "/initiator", transcript(context, nonce_i, nonce_r)),
                     deadline);
}

std::string handshake_respond(int fd, const Key& key, const std::string& label,
                              const std::string& context, double timeout_s) {
  const auto deadline = deadline_after(timeout_s);
  std::string hello;
  std::string err = read_bytes(fd, hello, 4 + kNonceBytes, deadline);
  if (!err.empty()) return err;
  if (std::memcmp(hello.data(), kHandshakeMagic, 4) != 0) return "not an smp handshake";
  const std::string nonce_i = hello.substr(4);
  const std::string nonce_r = random_bytes(kNonceBytes);
  err = write_bytes(
      fd, nonce_r + mac(key, label + "/responder", transcript(context, nonce_i, nonce_r)), deadline);
  if (!err.empty()) return err;
  std::string proof;
  err = read_bytes(fd, proof, kMacBytes, deadline);
  if (!err.empty()) return err;
  if (!verify(key, label + "/initiator", transcript(context, nonce_i, nonce_r), proof))
    return "the peer did not prove this job's secret (SMP_JOB_SECRET differs, or not one of "
           "this job's processes)";
  return "";
}

}  // namespace smp::auth
