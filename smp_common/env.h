// Reading a process's environment, the same way in smprun and in each rank: the map of
// variables, a variable's text as an integer, and MASTER_PORT's default. No torch (the
// launcher links it). What each variable means is the reader's: smp_core/runtime.h
// (ProcessEnv) for a rank's, launcher/scheduler_env.h for a scheduler's.
#pragma once

#include <map>
#include <optional>
#include <string>

namespace smp::common {

// MASTER_PORT where nothing names one and no process can pick a free port for the
// others: smprun on several nodes, and ranks started by srun or mpirun
// (python/smp/launch_env.py reads it as smp._C.DEFAULT_MASTER_PORT). torchrun's default.
constexpr int kDefaultMasterPort = 29500;

// Variables by name, as smprun hands them to a rank and tests pass them.
using EnvMap = std::map<std::string, std::string>;

// Snapshot of this process's environment (environ).
EnvMap current_env();

// The whole of `text` as a decimal int; nullopt on an empty text, any whitespace, other
// junk ("4x", "0x10") or a value outside int. A sign is allowed.
std::optional<int> parse_int(const std::string& text);

// `text` without leading and trailing whitespace (isspace).
std::string trim(const std::string& text);

// An on/off variable's text: "1" on, "0" off; nullopt on anything else. Every smp
// switch in the environment (SMP_REDUCER_SHM, SMP_P2P_LOCAL_SOCKET, SMP_OPTIM_GENERIC)
// is read through this, so each accepts the same words (smp_core/config.h env_flag).
std::optional<bool> parse_flag(const std::string& text);

}  // namespace smp::common
