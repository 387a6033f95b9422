// The job's secret and what it authenticates (Note [Job secret]; docs/security.md).
// Torch-free (smp_common): smprun and every rank use the same code.
//
// Note [Job secret]
// Every process of a job holds one secret key. smprun draws a random one per job and
// hands it to its ranks in SMP_JOB_SECRET. Across nodes the user (or the scheduler's
// prolog) supplies the same value to every node's smprun, in SMP_JOB_SECRET or in a
// file named by --secret_file. With it:
//   - a connection (the pipeline mesh, the launchers' control channel) is accepted only
//     after both ends prove that they hold the key, by an HMAC-SHA256 over fresh nonces
//     from both sides (challenge-response: a recorded handshake does not replay);
//   - a value smp puts in the c10d store carries an HMAC over its key and bytes, and a
//     value without a valid one is refused before it is decoded (or unpickled).
// Nothing is encrypted: the secret keeps strangers out; it does not hide the traffic.
// A process started without a secret (torchrun, srun, a script's own
// init_process_group) gets one that rank 0 draws and publishes in the store: as strong
// as access to the store, which is what torch itself relies on, and said in a warning.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace smp::auth {

constexpr size_t kKeyBytes = 32;
constexpr size_t kMacBytes = 32;  // HMAC-SHA256
constexpr size_t kNonceBytes = 16;
// Environment variables: the secret itself (hex, at least 32 digits), or a file holding it.
constexpr const char* kSecretEnv = "SMP_JOB_SECRET";
constexpr const char* kSecretFileEnv = "SMP_JOB_SECRET_FILE";

using Key = std::array<uint8_t, kKeyBytes>;

// `n` bytes from the kernel's CSPRNG (getrandom).
std::string random_bytes(size_t n);
std::string to_hex(const std::string& bytes);

// The key of a secret given as text: hex digits (at least 32), decoded and hashed into
// a key. Throws std::invalid_argument naming `where` and what is wrong.
Key key_from_secret(const std::string& text, const std::string& where);

// The secret held by the file `path` (surrounding whitespace dropped), checked as
// key_from_secret does. Throws std::invalid_argument naming `where` (the flag or
// variable that named the file) and `path` when it is unreadable or malformed.
std::string secret_from_file(const std::string& path, const std::string& where);

// The secret of this process's environment: SMP_JOB_SECRET, else the file named by
// SMP_JOB_SECRET_FILE, else "" (none). Throws std::invalid_argument if the file is
// unreadable or the value malformed.
std::string secret_from_env();

// HMAC-SHA256 of `data` under `key`, with `label` (what is authenticated) bound in so
// that a MAC of one kind never verifies as another.
std::string mac(const Key& key, const std::string& label, const std::string& data);
// Constant-time comparison of mac(key, label, data) with `tag`.
bool verify(const Key& key, const std::string& label, const std::string& data,
            const std::string& tag);

// The process's job key (Note [Job secret]): set once by smp's init (set_job_key), read
// by the store helpers and the pipeline mesh. has_job_key() is false before.
void set_job_key(const Key& key, bool from_environment = true);
bool has_job_key();
// Whether the key came from SMP_JOB_SECRET / SMP_JOB_SECRET_FILE (false: drawn by rank 0
// and shared through the store, Note [Job secret]).
bool job_key_from_environment();
const Key& job_key();  // throws std::logic_error before set_job_key

// A store value sealed under the job key: value || mac(key, "store:" + store_key, value).
std::string seal(const std::string& store_key, const std::string& value);
// The value of a sealed one; throws std::runtime_error naming `store_key` when its MAC is
// missing or wrong (written by a process without the job's secret).
std::string unseal(const std::string& store_key, const std::string& sealed);

// Challenge-response over a connected blocking socket (Note [Job secret]): `label`
// names the channel and `context` binds what both ends agree on (ranks, mesh id). The
// initiator sends its nonce; the responder answers with its own nonce and its proof;
// the initiator checks it and sends its own proof. Each returns "" once the peer proved
// the key, or why it did not (the caller closes the connection and logs). Reads wait at
// most `timeout_s` per step.
std::string handshake_initiate(int fd, const Key& key, const std::string& label,
                               const std::string& context, double timeout_s);
std::string handshake_respond(int fd, const Key& key, const std::string& label,
                              const std::string& context, double timeout_s);

}  // namespace smp::auth
