#pragma once

// For benchmarks that fork ranks which meet over c10d on this machine.

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

namespace stagewise::bench {

/// A port nobody listens on now: the kernel's choice for port 0 on loopback. `who` names the
/// benchmark in the error.
///   setenv("MASTER_PORT", std::to_string(free_loopback_port("my_bench")).c_str(), 1);
inline int free_loopback_port(const char* who) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  if (fd >= 0) ::close(fd);
  TORCH_CHECK(ok, who, ": no free port on loopback (socket, bind or getsockname failed)");
  return ntohs(addr.sin_port);
}

}  // namespace stagewise::bench
