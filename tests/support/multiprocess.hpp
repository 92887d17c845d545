#pragma once

// Test helper: runs a function in N forked processes set up as the ranks of one job on loopback
// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), with a deadline after which every
// rank still running is killed. Every child is reaped, whatever happens. Call it before the test
// process starts any thread (fork copies only the calling thread).

#include <c10/util/Exception.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace stagewise::testing {

/// How one rank ended: its exit code (or -signal when killed), and what it reported (its
/// exception's text, or what the body wrote through `report`).
struct RankOutcome {
  int status = 0;
  bool timed_out = false;
  std::string text;
};

/// A port nobody listens on now: bind port 0 on loopback and read what the kernel chose.
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "free_port: socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  ::close(fd);
  TORCH_CHECK(ok, "free_port: bind() failed");
  return ntohs(addr.sin_port);
}

namespace detail {
inline int& report_fd() {
  static int fd = -1;
  return fd;
}
}  // namespace detail

/// Inside a rank: text for the parent (appended to the rank's RankOutcome::text).
inline void report(const std::string& text) {
  if (detail::report_fd() >= 0) {
    [[maybe_unused]] auto n = ::write(detail::report_fd(), text.data(), text.size());
  }
}

/// Runs `body(rank)` in `world` child processes. A rank whose body returns exits 0; one whose
/// body throws reports the exception's text and exits 1. After `deadline` the ranks still
/// running are killed (timed_out). Returns one outcome per rank.
inline std::vector<RankOutcome> run_ranks(int world, const std::function<void(int)>& body,
                                          std::chrono::milliseconds deadline) {
  const int port = free_port();
  std::vector<pid_t> pids(static_cast<std::size_t>(world), -1);
  std::vector<int> pipes(static_cast<std::size_t>(world), -1);
  std::vector<RankOutcome> out(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r) {
    int fds[2];
    TORCH_CHECK(::pipe(fds) == 0, "run_ranks: pipe() failed");
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      for (int q = 0; q < r; ++q) ::close(pipes[static_cast<std::size_t>(q)]);
      detail::report_fd() = fds[1];
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      int code = 0;
      try {
        body(r);
      } catch (const c10::Error& e) {
        report(e.what_without_backtrace());
        code = 1;
      } catch (const std::exception& e) {
        report(e.what());
        code = 1;
      }
      ::_exit(code);  // no atexit handlers: the test framework's belong to the parent
    }
    ::close(fds[1]);
    if (pid < 0) {
      ::close(fds[0]);
      for (int q = 0; q < r; ++q) ::kill(pids[static_cast<std::size_t>(q)], SIGKILL);
      for (int q = 0; q < r; ++q) ::waitpid(pids[static_cast<std::size_t>(q)], nullptr, 0);
      TORCH_CHECK(false, "run_ranks: fork() failed");
    }
    ::fcntl(fds[0], F_SETFL, O_NONBLOCK);
    pids[static_cast<std::size_t>(r)] = pid;
    pipes[static_cast<std::size_t>(r)] = fds[0];
  }
  auto drain = [&](int r) {
    char buf[4096];
    for (ssize_t n; (n = ::read(pipes[static_cast<std::size_t>(r)], buf, sizeof buf)) > 0;) {
      out[static_cast<std::size_t>(r)].text.append(buf, static_cast<std::size_t>(n));
    }
  };
  const auto end = std::chrono::steady_clock::now() + deadline;
  int running = world;
  while (running > 0) {
    for (int r = 0; r < world; ++r) {
      auto& pid = pids[static_cast<std::size_t>(r)];
      if (pid < 0) continue;
      drain(r);
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        out[static_cast<std::size_t>(r)].status =
            WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status);
        pid = -1;
        --running;
      }
    }
    if (running > 0 && std::chrono::steady_clock::now() > end) {
      for (int r = 0; r < world; ++r) {
        const auto pid = pids[static_cast<std::size_t>(r)];
        if (pid < 0) continue;
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
        out[static_cast<std::size_t>(r)].timed_out = true;
        out[static_cast<std::size_t>(r)].status = -SIGKILL;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (int r = 0; r < world; ++r) {
    drain(r);
    ::close(pipes[static_cast<std::size_t>(r)]);
  }
  return out;
}

/// Rank `rank`'s outcome in run_ranks' result.
inline const RankOutcome& of(const std::vector<RankOutcome>& outcomes, int rank) {
  return outcomes[static_cast<std::size_t>(rank)];
}

}  // namespace stagewise::testing
