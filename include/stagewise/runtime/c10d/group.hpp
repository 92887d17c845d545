#pragma once

#include "stagewise/core/error_context.hpp"
#include "stagewise/runtime/c10d/collectives.hpp"
#include "stagewise/runtime/c10d/env.hpp"

#include <c10/util/Exception.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/version.h>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#ifndef USE_C10D_GLOO
#error \
    "stagewise's distributed headers need LibTorch's Gloo: compile with -DUSE_C10D_GLOO and Gloo's headers (Debian: libgloo-dev); Bazel: depend on //:distributed; CMake: link stagewise::distributed"
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <signal.h>

#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace stagewise::runtime {

/// A c10d process group (or, in LibTorch 2.x, a backend) that can send and receive tensors with a
/// tag: `c10d::ProcessGroupGloo`, `c10d::ProcessGroupNCCL`, or a `c10d::ProcessGroup` the user
/// already has.
///   static_assert(stagewise::runtime::point_to_point_group<c10d::ProcessGroupGloo>);
template <class G>
concept point_to_point_group = requires(G& g, std::vector<at::Tensor>& t, int peer, int tag) {
  { g.send(t, peer, tag) } -> std::convertible_to<c10::intrusive_ptr<c10d::Work>>;
  { g.recv(t, peer, tag) } -> std::convertible_to<c10::intrusive_ptr<c10d::Work>>;
  { g.getRank() } -> std::convertible_to<int>;
  { g.getSize() } -> std::convertible_to<int>;
};

/// The two calls stagewise needs from a process group, whatever its class in this LibTorch
/// version: tagged send and receive, plus this process's rank and the number of ranks.
///   stagewise::runtime::PointToPoint p2p(my_process_group);  // an intrusive_ptr to a group
class PointToPoint {
 public:
  template <point_to_point_group G>
  explicit PointToPoint(c10::intrusive_ptr<G> group)
      : send_([group](std::vector<at::Tensor>& t, int peer, int tag) {
          return c10::intrusive_ptr<c10d::Work>(group->send(t, peer, tag));
        }),
        recv_([group](std::vector<at::Tensor>& t, int peer, int tag) {
          return c10::intrusive_ptr<c10d::Work>(group->recv(t, peer, tag));
        }),
        rank_(group->getRank()),
        size_(group->getSize()) {}

  /// Starts sending `tensors` to rank `peer` under `tag`; wait on the returned work.
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int peer, int tag) const {
    return send_(tensors, peer, tag);
  }
  /// Starts receiving into `tensors` from rank `peer` under `tag`; wait on the returned work.
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int peer, int tag) const {
    return recv_(tensors, peer, tag);
  }
  int rank() const { return rank_; }
  int size() const { return size_; }

 private:
  using call = std::function<c10::intrusive_ptr<c10d::Work>(std::vector<at::Tensor>&, int, int)>;
  call send_;
  call recv_;
  int rank_;
  int size_;
};

/// A connected job: the rendezvous store (served by rank 0) and the process group over it.
struct Connection {
  RendezvousEnv env;
  c10::intrusive_ptr<c10d::Store> store;
  PointToPoint group;
  /// Whether this process serves `store` (rank 0 under `connect`): after a failure it then stays
  /// until the other ranks have read the cause from the store (bounded), so that they report it
  /// rather than the store's loss.
  bool serves_store = false;
  /// The same group's all-reduce and broadcast (data parallelism); empty if the caller built the
  /// connection without them.
  Collectives collectives = {};
  /// For a group inside a larger job (`runtime::subgroup`): the job rank of each of this group's
  /// ranks, and the job's number of ranks. Errors name job ranks, and a failure is acknowledged
  /// by every rank of the job. Empty and 0: the group is the whole job.
  std::vector<int> job_ranks = {};
  int job_size = 0;
  /// For a group inside a larger job: the whole job's collectives (what a pipe agrees on across
  /// the job between steps goes over them, e.g. the clip's gradient norms); empty otherwise.
  Collectives job_collectives = {};

  /// The job rank of this group's rank `r`.
  int job_rank(int r) const {
    return job_ranks.empty() ? r : job_ranks.at(static_cast<std::size_t>(r));
  }
  /// The number of ranks of the whole job.
  int job_world() const { return job_size > 0 ? job_size : env.world_size; }
  /// The whole job's collectives, in job-rank order: this group's when it is the job, else
  /// `job_collectives` (empty where the caller built the connection without them).
  const Collectives& across_job() const {
    return job_ranks.empty() ? collectives : job_collectives;
  }
};

/// Which c10d process group `connect` builds: Gloo (CPU tensors; every LibTorch) or NCCL (CUDA
/// tensors; only a LibTorch built with CUDA and NCCL, compiled with USE_C10D_NCCL).
enum class Backend { gloo, nccl };

/// How `connect` rendezvouses: how long rank 0 waits for the others and every rank waits for
/// rank 0's store, and over which backend.
///   stagewise::runtime::ConnectOptions{std::chrono::seconds(60), Backend::nccl}
struct ConnectOptions {
  std::chrono::milliseconds timeout{30000};
  Backend backend = Backend::gloo;
};

namespace detail {

template <class O>
void without_libuv(O& opts) {
  // LibTorch 2.4+ defaults to a libuv store server, which Debian's build lacks.
  if constexpr (requires { opts.useLibUV; }) opts.useLibUV = false;
}

inline bool is_loopback(const std::string& host) {
  return host == "127.0.0.1" || host == "localhost" || host == "::1";
}

// Runs `make` on a thread of its own and returns what it returns, or throws `late` (a message)
// when it has not returned within `limit`: LibTorch 1.13's TCPStore client sets no receive
// timeout, so a port held by a program that accepts connections but never answers would block
// its constructor forever. The thread is then left behind (detached, owning all it uses).
template <class Make>
auto within(std::chrono::milliseconds limit, Make make, const std::string& late) {
  using T = decltype(make());
  auto done = std::make_shared<std::promise<T>>();
  auto result = done->get_future();
  std::thread([done, make = std::move(make)]() mutable {
    try {
      done->set_value(make());
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  }).detach();
  TORCH_CHECK(result.wait_for(limit) == std::future_status::ready, late);
  return result.get();
}

// The store key by which rank `r` says it joined the job.
inline std::string joined_key(int r) {
  return "stagewise/joined/" + std::to_string(r);
}

// Waits until every rank has said it joined (joined_key, added by each rank as its first request),
// up to `deadline`; past it, the error names every rank that did not join.
inline void wait_for_ranks(c10d::Store& store, const RendezvousEnv& env,
                           std::chrono::steady_clock::time_point deadline,
                           std::chrono::milliseconds limit, const std::string& where) {
  const auto key = joined_key;
  std::vector<std::string> all;
  for (int r = 0; r < env.world_size; ++r) all.push_back(key(r));
  while (!store.check(all)) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::string missing;
      int count = 0;
      for (int r = 0; r < env.world_size; ++r) {
        if (store.check({key(r)})) continue;
        missing += (count++ ? ", " : "") + std::to_string(r);
      }
      if (count == 0) break;  // the last one joined just now
      TORCH_CHECK(false, "stagewise: rank ", env.rank, " of ", env.world_size, ": rank",
                  count == 1 ? " " : "s ", missing, count == 1 ? " has" : " have",
                  " not joined the job at ", where, " within ", limit.count(),
                  " ms; start every rank (WORLD_SIZE=", env.world_size,
                  ") within the timeout of the others, or raise it (ConnectOptions::timeout, "
                  "distributed::Options::timeout)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Gloo writes to its sockets without MSG_NOSIGNAL, so a peer that exits makes a write raise
// SIGPIPE, whose default action kills this process before any error is reported. Python ignores
// SIGPIPE at start-up, which is why PyTorch's jobs never see it; a C++ program has to. A handler
// the program installed itself is left alone.
inline void ignore_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    ::signal(SIGPIPE, SIG_IGN);
  }
}

inline std::string what_of(const std::exception& e) {
  return ::stagewise::detail::message_of(e);
}

// Builds the process group of `options.backend` over `store`, as rank `rank` of `size`: its
// point-to-point calls and its collectives. `master_addr` picks Gloo's interface (see connect),
// `where` names the rendezvous in errors.
inline std::pair<PointToPoint, Collectives> make_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                       int rank, int size,
                                                       const std::string& master_addr,
                                                       const ConnectOptions& options,
                                                       const std::string& where) {
  if (options.backend == Backend::nccl) {
#ifdef USE_C10D_NCCL
    auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
    nccl_options->timeout = options.timeout;
    auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, nccl_options);
    return {PointToPoint(group), Collectives(group)};
#else
    TORCH_CHECK(false, "stagewise: this LibTorch has no NCCL (compiled without USE_C10D_NCCL); ",
                "use Backend::gloo, or build against a CUDA LibTorch with -DUSE_C10D_NCCL");
#endif
  }
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname && *ifname) {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else if (is_loopback(master_addr)) {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
  try {
    group = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, gloo_options);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "stagewise: rank ", rank, " of ", size,
                " could not connect to the other ranks over Gloo (rendezvous at ", where,
                "); every rank must start within ", options.timeout.count(),
                " ms of the others: ", what_of(e));
  }
  return {PointToPoint(group), Collectives(group)};
}

}  // namespace detail

/// Joins the job `env` describes over Gloo (or NCCL, see ConnectOptions): rank 0 serves a
/// c10d::TCPStore at MASTER_PORT and waits for the others, every rank then builds a
/// c10d::ProcessGroupGloo over it. Gloo binds to the interface named by GLOO_SOCKET_IFNAME when
/// set, to loopback when MASTER_ADDR is loopback, else to the address this machine's hostname
/// resolves to. Failures name the address and fix.
///   auto c = stagewise::runtime::connect(stagewise::runtime::rendezvous_env());
inline Connection connect(const RendezvousEnv& env, ConnectOptions options = {}) {
  detail::ignore_sigpipe();  // before Gloo's threads start, so they inherit it
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(env.master_port);
  so.isServer = env.rank == 0;
  so.numWorkers = static_cast<std::size_t>(env.world_size);
  so.waitWorkers = false;  // the ranks join below, where a missing one is named
  so.timeout = options.timeout;
  detail::without_libuv(so);
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  c10::intrusive_ptr<c10d::Store> store;
  try {
    // Bounded even where the client cannot time out by itself (see within): the store's own
    // timeout first, then a second.
    store = detail::within(
        options.timeout + std::chrono::seconds(1),
        [host = env.master_addr, so,
         joined = detail::joined_key(env.rank)]() -> c10::intrusive_ptr<c10d::Store> {
          auto s = c10::make_intrusive<c10d::TCPStore>(host, so);
          // The first request, where a silent peer blocks a 1.13 client: this rank has joined.
          // (add waits for the store's answer; set, on 1.13, does not).
          s->add(joined, 1);
          return s;
        },
        "no answer from a c10d store there within " + std::to_string(options.timeout.count()) +
            " ms (another program holds that port, or rank 0 is stuck)");
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "stagewise: rank ", env.rank, " of ", env.world_size,
                " could not rendezvous at ", where,
                env.rank == 0 ? " (rank 0 serves the store there: is the port free?)"
                              : " (rank 0 serves the store there: is it running, and are "
                                "MASTER_ADDR and MASTER_PORT the same on every rank?)",
                ": ", detail::what_of(e));
  }
  detail::wait_for_ranks(*store, env, deadline, options.timeout, where);
  auto [p2p, collectives] =
      detail::make_group(store, env.rank, env.world_size, env.master_addr, options, where);
  return Connection{env, store, std::move(p2p), /*serves_store=*/env.rank == 0,
                    std::move(collectives)};
}

}  // namespace stagewise::runtime
