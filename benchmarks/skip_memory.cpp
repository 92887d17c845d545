// skip_memory: a U-Net's skip connections through portals versus the same skips passed as extra
// tuple outputs through every stage (what users write without skip support). 3 stages, chunks 8,
// checkpoint except_last; peak tensor memory of one training step, and its time in alternating
// rounds (median [min, max]); then the same across 3 ranks: bytes sent and peak memory per rank.
//   ./bazelw run -c opt //benchmarks:skip_memory
// In one process all stages share one CPU device, so neither path copies a tensor: those rows are
// the control. What portals save shows where a skip crosses ranks: the same model then runs as a
// distributed::Pipe in 3 processes over Gloo on loopback (one stage each), where a portal sends
// a skip once, to the popping stage, and a tuple carries it through every stage between; those
// rows give the bytes each rank sent (the transport's own count) and each rank's peak tensor
// memory.
#include <stagewise/distributed.hpp>
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "benchmarks/common/conditions.hpp"
#include "benchmarks/common/loopback.hpp"
#include "benchmarks/common/memory.hpp"
#include "benchmarks/common/rounds.hpp"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>

namespace sw = stagewise;
using torch::Tensor;

namespace {

struct Level1 {};
struct Level2 {};
template <class Level>
using features = sw::skip<Level, "features">;

torch::nn::Conv2d conv3(int64_t in, int64_t out) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1));
}

// An encoder level's features and a decoder level's merge, shared by both paths.
Tensor conv_features(torch::nn::Conv2d& conv, const Tensor& x) {
  return torch::relu(conv(x));
}
Tensor merge_of(torch::nn::Conv2d& conv, const Tensor& x, const Tensor& skip) {
  auto up = torch::upsample_nearest2d(x, {x.size(2) * 2, x.size(3) * 2});
  return torch::relu(conv(torch::cat({up, skip}, 1)));
}

// Encoder level: features(x) is the computation, forward adds the stash and the downsampling.
template <class Level>
struct DownImpl : sw::Skippable<DownImpl<Level>, sw::stashes<features<Level>>> {
  DownImpl(int64_t in, int64_t out) : conv(this->register_module("conv", conv3(in, out))) {}
  Tensor features_of(const Tensor& x) { return conv_features(conv, x); }
  Tensor forward(Tensor x) {
    auto h = features_of(x);
    sw::stash<features<Level>>(this, h);
    return torch::max_pool2d(h, 2);
  }
  torch::nn::Conv2d conv;
};
template <class Level>
using Down = torch::nn::ModuleHolder<DownImpl<Level>>;

// Decoder level: merge(x, skip) is the computation, forward pops the skip.
template <class Level>
struct UpImpl : sw::Skippable<UpImpl<Level>, sw::pops<features<Level>>> {
  UpImpl(int64_t in, int64_t skip, int64_t out)
      : conv(this->register_module("conv", conv3(in + skip, out))) {}
  Tensor merge(const Tensor& x, const Tensor& skip) { return merge_of(conv, x, skip); }
  Tensor forward(Tensor x) { return merge(x, sw::pop<features<Level>>(this)); }
  torch::nn::Conv2d conv;
};
template <class Level>
using Up = torch::nn::ModuleHolder<UpImpl<Level>>;

struct Model {
  Down<Level1> d1{3, 32};
  Down<Level2> d2{32, 64};
  torch::nn::Conv2d mid = conv3(64, 64);
  Up<Level2> u2{64, 64, 32};
  Up<Level1> u1{32, 32, 16};
  torch::nn::Conv2d head{torch::nn::Conv2dOptions(16, 1, 1)};
};

using Triple = std::tuple<Tensor, Tensor, Tensor>;
using Pair = std::tuple<Tensor, Tensor>;

// ---- The same U-Net as a Sequential, for stages on different ranks ----

// Portals: the six layers, balance {2, 2, 2}; the skips are not in the stage interfaces.
torch::nn::Sequential portal_sequential() {
  torch::manual_seed(0);
  Model m;
  return torch::nn::Sequential(m.d1, m.d2, m.mid, m.u2, m.u1, m.head);
}

// Tuples: one layer per stage (balance {1, 1, 1}) that returns the skips beside its output; the
// middle stage receives the first level's skip only to pass it on. The convolutions are made in
// the order Model makes them, so both paths start from the same weights.
struct EncoderStageImpl : torch::nn::Module {
  Triple forward(Tensor x) {
    auto s1 = conv_features(c1, x);
    auto s2 = conv_features(c2, torch::max_pool2d(s1, 2));
    return {torch::max_pool2d(s2, 2), s1, s2};
  }
  torch::nn::Conv2d c1 = register_module("c1", conv3(3, 32));
  torch::nn::Conv2d c2 = register_module("c2", conv3(32, 64));
};
TORCH_MODULE(EncoderStage);

struct MiddleStageImpl : torch::nn::Module {
  Pair forward(Triple in) {
    auto [h, s1, s2] = in;
    return {merge_of(u2, mid(h), s2), s1};
  }
  torch::nn::Conv2d mid = register_module("mid", conv3(64, 64));
  torch::nn::Conv2d u2 = register_module("u2", conv3(64 + 64, 32));
};
TORCH_MODULE(MiddleStage);

struct DecoderStageImpl : torch::nn::Module {
  Tensor forward(Pair in) {
    auto [h, s1] = in;
    return head(merge_of(u1, h, s1));
  }
  torch::nn::Conv2d u1 = register_module("u1", conv3(32 + 32, 16));
  torch::nn::Conv2d head =
      register_module("head", torch::nn::Conv2d(torch::nn::Conv2dOptions(16, 1, 1)));
};
TORCH_MODULE(DecoderStage);

torch::nn::Sequential tuple_sequential() {
  torch::manual_seed(0);
  EncoderStage e;
  MiddleStage m;
  DecoderStage d;
  return torch::nn::Sequential(e, m, d);
}

constexpr int kRanks = 3;

// What one rank measured for one path (sent to the parent through a pipe).
struct RankResult {
  int rank = 0;
  int path = 0;  // 0 portals, 1 tuples
  double peak_mib = 0;
  long long bytes_sent = 0;
  double loss = 0;
};

// One rank: both paths in turn, each a distributed::Pipe over one connection (its own store
// prefix), one warm-up step and one measured step (chunks 8, checkpoint except_last, GPipe).
[[noreturn]] void rank_main(int rank, int port, int results) {
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(kRanks).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  int code = 0;
  try {
    using namespace std::chrono_literals;
    at::set_num_threads(1);
    auto& memory = sw::bench::counting_allocator();
    auto c = sw::runtime::connect(sw::runtime::rendezvous_env(), {60s});
    torch::manual_seed(1);
    const auto x = torch::randn({64, 3, 64, 64});
    const auto target = torch::randn({64, 1, 64, 64});
    for (int path = 0; path < 2; ++path) {
      sw::distributed::Pipe pipe(
          c, path == 0 ? portal_sequential() : tuple_sequential(),
          path == 0 ? sw::balance{2, 2, 2} : sw::balance{1, 1, 1},
          sw::PipeOptions().chunks(8).checkpoint(sw::Checkpoint::except_last),
          sw::distributed::Options().transport(
              sw::runtime::C10dOptions().prefix(path == 0 ? "portals" : "tuples").timeout(120s)));
      auto step = [&] {
        return pipe->train_step(
            rank == 0 ? x : Tensor(), rank == kRanks - 1 ? target : Tensor(),
            [](const Tensor& o, const Tensor& t) { return torch::mse_loss(o, t); });
      };
      step();  // warm-up: gradients exist from here on
      memory.reset_peak();
      const long long base = memory.current();
      const auto before = pipe->traffic();
      const auto loss = step();
      const auto after = pipe->traffic();
      RankResult r;
      r.rank = rank;
      r.path = path;
      r.peak_mib = double(memory.peak() - base) / (1 << 20);
      r.bytes_sent = after.bytes_sent - before.bytes_sent;
      r.loss = loss.item<double>();
      TORCH_CHECK(::write(results, &r, sizeof r) == sizeof r, "skip_memory: rank ", rank,
                  " could not report");
    }
    // Rank 0 serves the store: it leaves last.
    c.store->add("skip_memory/done", 1);
    while (rank == 0 && c.store->add("skip_memory/done", 0) < kRanks) {
      std::this_thread::sleep_for(10ms);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "skip_memory: rank %d: %s\n", rank, e.what());
    code = 1;
  }
  std::fflush(stderr);
  ::_exit(code);
}

// Forks the ranks (call while this process has one thread), collects their 2 results each within
// `limit`, and reaps them, killing any that are still there. Results indexed [path][rank]; a
// rank that failed leaves its entries at nan.
std::array<std::array<RankResult, kRanks>, 2> run_ranks(std::chrono::seconds limit) {
  std::array<std::array<RankResult, kRanks>, 2> out{};
  for (auto& path : out) {
    for (auto& r : path) r.peak_mib = r.loss = std::nan("");
  }
  int fds[2];
  TORCH_CHECK(::pipe(fds) == 0, "skip_memory: pipe() failed");
  const int port = sw::bench::free_loopback_port("skip_memory");
  std::vector<pid_t> pids;
  for (int r = 0; r < kRanks; ++r) {
    const pid_t pid = ::fork();
    TORCH_CHECK(pid >= 0, "skip_memory: fork() failed");
    if (pid == 0) {
      ::close(fds[0]);
      rank_main(r, port, fds[1]);
    }
    pids.push_back(pid);
  }
  ::close(fds[1]);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (int got = 0; got < 2 * kRanks;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{fds[0], POLLIN, 0};
    if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) <= 0) {
      std::fprintf(stderr, "skip_memory: the ranks did not report within %lld s\n",
                   static_cast<long long>(limit.count()));
      break;
    }
    RankResult r;
    if (::read(fds[0], &r, sizeof r) != static_cast<ssize_t>(sizeof r)) break;  // all exited
    out[static_cast<std::size_t>(r.path)][static_cast<std::size_t>(r.rank)] = r;
    ++got;
  }
  ::close(fds[0]);
  for (auto pid : pids) {
    int status = 0;
    for (int k = 0; k < 500 && ::waitpid(pid, &status, WNOHANG) == 0; ++k) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (::waitpid(pid, &status, WNOHANG) == 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
  }
  return out;
}

void row(const std::string& what, double value, const std::string& unit) {
  std::printf("  %-58s %12.2f %s\n", what.c_str(), value, unit.c_str());
}

}  // namespace

int main() {
  // The ranks first, while this process has one thread; they finish before the timing below.
  const auto ranked = run_ranks(std::chrono::seconds(600));
  at::set_num_threads(1);
  torch::manual_seed(0);
  sw::bench::Conditions conditions("skip_memory");
  auto& memory = sw::bench::counting_allocator();
  Model m;

  // Portals: each stage is a seq of the layers; the skips are not in the stage interfaces.
  auto portal_pipe =
      sw::Pipe(sw::stages(sw::seq(m.d1, m.d2), sw::seq(m.mid, m.u2), sw::seq(m.u1, m.head)),
               sw::PipeOptions().chunks(8).checkpoint(sw::Checkpoint::except_last));

  // Tuples: the same layers, the skips returned by stage 0 and carried through stage 1.
  auto stage0 = [m](const Tensor& x) mutable -> Triple {
    auto s1 = m.d1->features_of(x);
    auto s2 = m.d2->features_of(torch::max_pool2d(s1, 2));
    return {torch::max_pool2d(s2, 2), s1, s2};
  };
  auto stage1 = [m](const Tensor& h, const Tensor& s1, const Tensor& s2) mutable -> Pair {
    return {m.u2->merge(m.mid(h), s2), s1};
  };
  auto stage2 = [m](const Tensor& h, const Tensor& s1) mutable -> Tensor {
    return m.head(m.u1->merge(h, s1));
  };
  auto tuple_pipe = sw::Pipe(sw::stages(stage0, stage1, stage2),
                             sw::PipeOptions().chunks(8).checkpoint(sw::Checkpoint::except_last));

  auto x = torch::randn({64, 3, 64, 64});
  auto target = torch::randn({64, 1, 64, 64});
  auto forward_step = [&](auto& pipe) {
    return [&] { torch::mse_loss(pipe->forward(x), target).backward(); };
  };
  auto train_step = [&](auto& pipe) {
    return [&] {
      pipe->train_step(x, target,
                       [](const Tensor& o, const Tensor& t) { return torch::mse_loss(o, t); });
    };
  };
  auto peak_of = [&](const std::function<void()>& step) {
    step();  // warm-up: gradients exist from here on
    memory.reset_peak();
    const long long base = memory.current();
    step();
    return double(memory.peak() - base) / (1 << 20);
  };

  // Same results first (the two pipes share every parameter).
  auto params = portal_pipe->parameters();
  auto grads_after = [&](const std::function<void()>& step) {
    for (auto& p : params) p.mutable_grad().reset();
    step();
    std::vector<Tensor> g;
    for (auto& p : params) g.push_back(p.grad().clone());
    return g;
  };
  const auto g_portal = grads_after(forward_step(portal_pipe));
  const auto g_tuple = grads_after(forward_step(tuple_pipe));
  bool same = true;
  for (std::size_t k = 0; k < params.size(); ++k)
    same = same && torch::allclose(g_portal[k], g_tuple[k], 1e-4, 1e-6);

  const double fwd_portal_peak = peak_of(forward_step(portal_pipe));
  const double fwd_tuple_peak = peak_of(forward_step(tuple_pipe));
  const double train_portal_peak = peak_of(train_step(portal_pipe));
  const double train_tuple_peak = peak_of(train_step(tuple_pipe));

  // Alternate the two paths so that load from elsewhere on the machine hits both alike.
  sw::bench::Rounds rounds(/*rounds=*/5, /*calls=*/3);
  rounds.add("forward+backward, portals", forward_step(portal_pipe));
  rounds.add("forward+backward, tuples", forward_step(tuple_pipe));
  rounds.add("train_step, portals", train_step(portal_pipe));
  rounds.add("train_step, tuples", train_step(tuple_pipe));
  rounds.run();
  const auto fwd_ratio = rounds.wall_ratio("forward+backward, portals", "forward+backward, tuples");
  const auto train_ratio = rounds.wall_ratio("train_step, portals", "train_step, tuples");

  std::printf(
      "skip_memory: U-Net (2 levels, 32/64 channels, 64x64), batch 64, 3 stages, chunks 8,\n"
      "checkpoint except_last, 1 intra-op thread per worker\n");
  std::printf("gradients of the two paths equal: %s\n", same ? "yes" : "NO");
  std::printf("control: every stage on one CPU device, nothing copied on either path\n");
  rounds.print();
  std::printf("pipe->forward(x) + backward (torchgpipe style)\n");
  row("peak tensor memory, skips through portals", fwd_portal_peak, "MiB");
  row("peak tensor memory, skips as tuple outputs", fwd_tuple_peak, "MiB");
  sw::bench::print_figure("time ratio portal / tuple (per round)", fwd_ratio, "");
  std::printf("pipe->train_step(x, target, mse)\n");
  row("peak tensor memory, skips sent to the popping stage", train_portal_peak, "MiB");
  row("peak tensor memory, skips as tuple outputs", train_tuple_peak, "MiB");
  row("train_step peak ratio portal / tuple", train_portal_peak / train_tuple_peak, "");
  sw::bench::print_figure("train_step time ratio portal / tuple (per round)", train_ratio, "");
  std::printf(
      "stages on different ranks: distributed::Pipe, %d processes over Gloo on loopback, one\n"
      "stage each, same chunks and checkpointing; one step after a warm-up step\n",
      kRanks);
  const auto& portal = ranked[0];
  const auto& tuple = ranked[1];
  std::printf("losses of the two paths equal: %s\n",
              portal[kRanks - 1].loss == tuple[kRanks - 1].loss ? "yes" : "NO");
  std::printf("  %-6s %16s %16s %16s %16s\n", "rank", "MiB sent portal", "MiB sent tuple",
              "peak MiB portal", "peak MiB tuple");
  double sent_portal = 0, sent_tuple = 0, fullest_portal = 0, fullest_tuple = 0;
  for (int r = 0; r < kRanks; ++r) {
    const auto& p = portal[static_cast<std::size_t>(r)];
    const auto& t = tuple[static_cast<std::size_t>(r)];
    std::printf("  %-6d %16.2f %16.2f %16.2f %16.2f\n", r, double(p.bytes_sent) / (1 << 20),
                double(t.bytes_sent) / (1 << 20), p.peak_mib, t.peak_mib);
    sent_portal += double(p.bytes_sent);
    sent_tuple += double(t.bytes_sent);
    fullest_portal = std::max(fullest_portal, p.peak_mib);
    fullest_tuple = std::max(fullest_tuple, t.peak_mib);
  }
  const double bytes_ratio = sent_portal / sent_tuple;
  const double rank_peak_ratio = fullest_portal / fullest_tuple;
  row("bytes moved per step, portals / tuples", bytes_ratio, "");
  row("peak memory of the fullest stage, portals / tuples", rank_peak_ratio, "");
  conditions.print_end();

  const bool ranks_ok = !std::isnan(bytes_ratio) && !std::isnan(rank_peak_ratio) &&
                        portal[kRanks - 1].loss == tuple[kRanks - 1].loss;
  std::ostringstream last;
  last << std::fixed << std::setprecision(3)
       << "skip_memory portal_peak_ratio=" << fwd_portal_peak / fwd_tuple_peak
       << " time_ratio=" << fwd_ratio.median << " rank_bytes_ratio=" << bytes_ratio
       << " rank_peak_ratio=" << rank_peak_ratio;
  std::cout << last.str() << std::endl;
  return same && ranks_ok ? 0 : 1;
}
