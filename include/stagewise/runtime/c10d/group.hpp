#pragma once

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

#include <chrono>
#include <concepts>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
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

inline std::string what_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace detail

/// Joins the job `env` describes over Gloo (or NCCL, see ConnectOptions): rank 0 serves a
/// c10d::TCPStore at MASTER_PORT and waits for the others, every rank then builds a
/// c10d::ProcessGroupGloo over it. Gloo binds to the interface named by GLOO_SOCKET_IFNAME when
/// set, to loopback when MASTER_ADDR is loopback, else to the address this machine's hostname
/// resolves to. Failures name the address and fix.
///   auto c = stagewise::runtime::connect(stagewise::runtime::rendezvous_env());
inline Connection connect(const RendezvousEnv& env, ConnectOptions options = {}) {
  c10d::TCPStoreOptions so;
  so.port = static_cast<std::uint16_t>(env.master_port);
  so.isServer = env.rank == 0;
  so.numWorkers = static_cast<std::size_t>(env.world_size);
  so.waitWorkers = true;
  so.timeout = options.timeout;
  detail::without_libuv(so);
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "stagewise: rank ", env.rank, " of ", env.world_size,
                " could not rendezvous at ", where,
                env.rank == 0 ? " (rank 0 serves the store there: is the port free?)"
                              : " (rank 0 serves the store there: is it running, and are "
                                "MASTER_ADDR and MASTER_PORT the same on every rank?)",
                ": ", detail::what_of(e));
  }
  if (options.backend == Backend::nccl) {
#ifdef USE_C10D_NCCL
    auto nccl_options = c10d::ProcessGroupNCCL::Options::create();
    nccl_options->timeout = options.timeout;
    auto group =
        c10::make_intrusive<c10d::ProcessGroupNCCL>(store, env.rank, env.world_size, nccl_options);
    return Connection{env, store, PointToPoint(group), /*serves_store=*/env.rank == 0};
#else
    TORCH_CHECK(false, "stagewise: this LibTorch has no NCCL (compiled without USE_C10D_NCCL); ",
                "use Backend::gloo, or build against a CUDA LibTorch with -DUSE_C10D_NCCL");
#endif
  }
  auto gloo_options = c10d::ProcessGroupGloo::Options::create(options.timeout);
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname && *ifname) {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else if (detail::is_loopback(env.master_addr)) {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else {
    gloo_options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  try {
    auto group =
        c10::make_intrusive<c10d::ProcessGroupGloo>(store, env.rank, env.world_size, gloo_options);
    return Connection{env, store, PointToPoint(group), /*serves_store=*/env.rank == 0};
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "stagewise: rank ", env.rank, " of ", env.world_size,
                " could not connect to the other ranks over Gloo (rendezvous at ", where,
                "); every rank must start within ", options.timeout.count(),
                " ms of the others: ", detail::what_of(e));
  }
}

}  // namespace stagewise::runtime
