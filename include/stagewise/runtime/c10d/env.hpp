#pragma once

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdlib>
#include <string>

namespace stagewise::runtime {

/// Where this process stands in a multi-process job, as `torchrun` (or `tools/launch`) describes
/// it in the environment: the rendezvous address and port (rank 0 serves the c10d::TCPStore
/// there), this process's rank, the number of processes, and the rank on this machine.
///   auto env = stagewise::runtime::rendezvous_env();  // RANK=1 WORLD_SIZE=2 ... in the env
///   env.rank;  // 1
struct RendezvousEnv {
  std::string master_addr;
  int master_port = 0;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
};

namespace detail {

inline const char* const rendezvous_fix =
    ". Start every rank with MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK set, as "
    "torchrun does, e.g. tools/launch -n 2 -- ./train";

inline std::string env_string(const char* name) {
  const char* value = std::getenv(name);
  TORCH_CHECK(value != nullptr && *value != '\0', "stagewise: the environment variable ", name,
              " is not set", rendezvous_fix);
  return value;
}

inline int env_int(const char* name, long low, long high) {
  const std::string text = env_string(name);
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  TORCH_CHECK(errno == 0 && end != text.c_str() && *end == '\0' && value >= low && value <= high,
              "stagewise: the environment variable ", name, " is '", text, "', not an integer in ",
              low, "..", high, rendezvous_fix);
  return static_cast<int>(value);
}

}  // namespace detail

/// Reads MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK (LOCAL_RANK defaults to RANK
/// when unset). A missing or malformed variable, or a RANK outside 0..WORLD_SIZE-1, throws
/// c10::Error naming the variable and how to set it.
///   auto env = stagewise::runtime::rendezvous_env();
inline RendezvousEnv rendezvous_env() {
  RendezvousEnv env;
  env.master_addr = detail::env_string("MASTER_ADDR");
  env.master_port = detail::env_int("MASTER_PORT", 1, 65535);
  env.world_size = detail::env_int("WORLD_SIZE", 1, 1 << 20);
  env.rank = detail::env_int("RANK", 0, env.world_size - 1);
  const char* local = std::getenv("LOCAL_RANK");
  env.local_rank = local && *local ? detail::env_int("LOCAL_RANK", 0, 1 << 20) : env.rank;
  return env;
}

}  // namespace stagewise::runtime
