// distributed_cpu: stagewise's distributed pipe (2 ranks over Gloo, one intra-op thread each)
// against the same micro-batched model run sequentially in one process, against the in-process
// pipe, and against torch.distributed.pipelining's GPipe (benchmarks/anchors/torch_pipelining.py,
// nan where PyTorch < 2.4). Model: 2 stages of Linear(512,512), ReLU, Linear(512,512), ReLU;
// batch 128, chunks 8; one step is forward and backward of the batch. Variants alternate in
// rounds; each prints min / median / max of its per-round medians, and each ratio is taken within
// a round (the last line gives the medians of the ratios). Then data parallelism: the whole
// model (all 8 layers) with distributed::DataParallel on the 2 ranks, each on 64 rows, against
// one process on the whole batch of 128 rows; the bytes each rank all-reduces per step against
// the ring all-reduce's 2(d-1)/d x the gradients' size; and the share of the reductions' time
// hidden behind backward: 1 - (DP step - the same step without communication) / (the step's
// all-reduces alone). Then pipeline x data parallel: 2 stages x 2 replicas on 4 more ranks
// (distributed::Options().data_parallel(2), 1 MiB buckets; rank r runs stage r % 2 of replica
// r / 2), each replica on its 64 rows, against the one-replica pipe on 2 ranks on the whole batch
// (the "distributed, gpipe" step above), alternating in rounds; and the bytes each rank
// all-reduces per step against the ring all-reduce's 2(d-1)/d x its stage's gradients; as a check,
// one step's loss and stage 0's gradient norm against the one-replica pipe's. Also, on the 2
// ranks, the clipped step (pipe->clip_grad_norm_step around the GPipe step with a fused SGD)
// against the same fused step unclipped, alternating in rounds (clip_step_ratio: the clip runs
// the step twice, a norm pass and the update, and gathers every rank's gradient norms between
// them; so about 2 plus the gather's share), and that gather alone (an empty closure).
//   ./bazelw run -c opt //benchmarks:distributed_cpu [-- --blas=openblas]
//   [-- --pipe-only]  (the first table and the clipped step alone: sequential, in-process and
//   distributed pipes; the key line gives nan for the rest, e.g. before/after a change to the
//   transport)
//   [-- --sharded-only]  (the sharded-state section alone, below)
// Last, optimizer state sharded over data-parallel replicas (ZeRO; benchmarks/common/zero_job.hpp):
// 2 stages x 2 replicas (4 more ranks) of 8 x [Linear(512,512), ReLU] per stage, and the same 16
// layers under DataParallel on 2 ranks, Adam, each variant (unsharded, sharded state, sharded
// state and gradients; unfused and fused) timed in alternating rounds on 64 rows per replica and
// chunks 8 (zero_step_ratio: sharded state and gradients, fused / unsharded, fused, per round),
// and measured in bytes per parameter of a rank's stage at its step's peak on 1-row
// micro-batches (zero_bytes_per_param: the same variant); and each way of reduce-scattering a
// 4 MiB bucket against the all-reduce, alone.
#include <stagewise/distributed.hpp>
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "benchmarks/common/blas.hpp"
#include "benchmarks/common/conditions.hpp"
#include "benchmarks/common/flags.hpp"
#include "benchmarks/common/key_values.hpp"
#include "benchmarks/common/loopback.hpp"
#include "benchmarks/common/rounds.hpp"
#include "benchmarks/common/stats.hpp"
#include "benchmarks/common/timing.hpp"
#include "benchmarks/common/zero_job.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

namespace sw = stagewise;
using sw::bench::median_us;

namespace {

constexpr int kRounds = 7;
constexpr int kSteps = 10;    // timed steps per variant and round (median taken)
constexpr int kReplicas = 2;  // the 2x2 pipe's replicas, of 2 stages (ranks) each
constexpr double kClipNorm = 1.0;  // the clipped step's max_norm

torch::Tensor mse(const torch::Tensor& o, const torch::Tensor& t) {
  return torch::mse_loss(o, t);
}

// Two stages of Linear(512,512), ReLU, Linear(512,512), ReLU (balance {4, 4}).
torch::nn::Sequential model() {
  torch::manual_seed(0);
  return torch::nn::Sequential(torch::nn::Linear(512, 512), torch::nn::ReLU(),
                               torch::nn::Linear(512, 512), torch::nn::ReLU(),
                               torch::nn::Linear(512, 512), torch::nn::ReLU(),
                               torch::nn::Linear(512, 512), torch::nn::ReLU());
}

std::pair<torch::Tensor, torch::Tensor> batch() {
  torch::manual_seed(1);
  return {torch::randn({128, 512}), torch::randn({128, 512})};
}

// One rank of the distributed pipe: runs a variant when the parent asks ('g' gpipe, 'o' 1F1B,
// 'f' gpipe with a fused SGD step, 'c' that step clipped by pipe->clip_grad_norm_step, 'x' the
// clip's norm gather alone, 'e' the end-of-step agreement alone, 'q' quit) and, on rank 0,
// answers with the median step time in microseconds; 'l': one gpipe step, then the loss and the
// norm of stage 0's gradients.
[[noreturn]] void rank_main(int rank, int port, int commands, int answers) {
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", "2", 1);
  setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  int code = 0;
  try {
    at::set_num_threads(1);
    const auto connection = sw::runtime::connect(sw::runtime::rendezvous_env());
    sw::distributed::Pipe pipe(connection, model(), sw::balance{4, 4},
                               sw::PipeOptions().chunks(8).checkpoint(sw::Checkpoint::never));
    // The agreement every train_step ends with (C10dTransport::end_step: each rank tells the
    // other it finished and waits for the same), timed alone over a transport of its own.
    sw::runtime::C10dTransport agreement(
        connection, [](int stage) { return stage; }, {},
        sw::runtime::C10dOptions().prefix("distributed_cpu/agreement"));
    auto [x, t] = batch();
    auto params = pipe->parameters();
    // The fused step of 'f' and 'c' (a tiny learning rate: the model hardly moves), detached
    // while the other variants run, which step nothing.
    sw::optim::FusedStep fused(pipe->parameters(), torch::optim::SGDOptions(1e-6));
    fused.detach();
    // Data parallel: the whole model on each rank, each on its 64 of the 128 rows.
    auto whole = model();
    sw::distributed::DataParallel dp(connection, whole,
                                     sw::distributed::DataParallelOptions().bucket_bytes(1 << 20));
    const auto dx = dp.shard(x), dt = dp.shard(t);
    auto dp_step = [&] {
      for (auto& p : whole->parameters()) p.mutable_grad() = torch::Tensor();
      mse(dp.forward(dx), dt).backward();
    };
    // The same all-reduces as one DP step, alone (one flat tensor per bucket).
    std::vector<torch::Tensor> flats;
    for (const auto& b : dp.buckets()) {
      std::int64_t n = 0;
      for (const auto i : b) n += whole->parameters()[i].numel();
      flats.push_back(torch::zeros({n}));
    }
    auto reduce_only = [&] {
      std::vector<c10::intrusive_ptr<c10d::Work>> works;
      for (auto& f : flats) {
        std::vector<at::Tensor> one{f};
        works.push_back(connection.collectives.all_reduce_sum(one));
      }
      for (auto& w : works) w->wait();
    };
    for (char c; ::read(commands, &c, 1) == 1 && c != 'q';) {
      if (c == 'l') {
        for (auto& p : params) p.mutable_grad() = torch::Tensor();
        const double loss = pipe->train_step(x, t, mse, sw::schedule::gpipe{}).item<double>();
        double norm2 = 0;
        for (const auto& p : params) norm2 += p.grad().pow(2).sum().item<double>();
        const double answer[2] = {loss, std::sqrt(norm2)};
        if (rank == 0) {
          [[maybe_unused]] auto n = ::write(answers, answer, sizeof answer);
        }
        continue;
      }
      if (c == 'f' || c == 'c' || c == 'x') {
        fused.attach();
        auto fused_step = [&] { pipe->train_step(x, t, mse, fused, sw::schedule::gpipe{}); };
        double us = 0;
        if (c == 'f') us = median_us(fused_step, kSteps, 2);
        if (c == 'c') {
          us = median_us([&] { pipe->clip_grad_norm_step(fused, fused_step, kClipNorm); }, kSteps,
                         2);
        }
        if (c == 'x') {  // no backward: the clip measures no norm, and gathers the empty lists
          us = median_us([&] { pipe->clip_grad_norm_step(fused, [] {}, kClipNorm); }, 200, 20);
        }
        fused.detach();
        if (rank == 0) {
          [[maybe_unused]] auto n = ::write(answers, &us, sizeof us);
        }
        continue;
      }
      if (c == 'd' || c == 'n' || c == 'r' || c == 'b') {
        double us = 0;
        if (c == 'd') us = median_us(dp_step, kSteps, 2);
        if (c == 'n') {
          auto local = dp.no_sync();
          us = median_us(dp_step, kSteps, 2);
        }
        if (c == 'r') us = median_us(reduce_only, kSteps, 2);
        if (c == 'b') {
          dp_step();
          us = static_cast<double>(dp.bytes_reduced_last_step());
        }
        if (rank == 0) {
          [[maybe_unused]] auto n = ::write(answers, &us, sizeof us);
        }
        continue;
      }
      auto step = [&] {
        for (auto& p : params) p.mutable_grad() = torch::Tensor();
        if (c == 'g') {
          pipe->train_step(x, t, mse, sw::schedule::gpipe{});
        } else {
          pipe->train_step(x, t, mse, sw::schedule::one_f_one_b{});
        }
      };
      const double us =
          c == 'e' ? median_us([&] { agreement.end_step(); }, 200, 20) : median_us(step, kSteps, 2);
      if (rank == 0) {
        [[maybe_unused]] auto n = ::write(answers, &us, sizeof us);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    code = 1;
  }
  std::fflush(stdout);
  ::_exit(code);
}

// One rank of the 2-stage x 2-replica pipe, a job of 4 ranks of its own (rank r runs stage r % 2
// of replica r / 2). It joins the job at the first command, so that the 2-rank job's rows above
// are measured without it. 'p': a GPipe step of the replica's 64 rows, the median step time in
// microseconds; 'y': one step, then the bytes it all-reduces, its stage's gradient bytes, the
// loss and the norm of its stage's gradients; 'q' quit. Rank 0 (stage 0 of replica 0) answers.
[[noreturn]] void replica_rank_main(int rank, int port, int commands, int answers) {
  setenv("MASTER_ADDR", "127.0.0.1", 1);
  setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  setenv("RANK", std::to_string(rank).c_str(), 1);
  setenv("WORLD_SIZE", std::to_string(2 * kReplicas).c_str(), 1);
  setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  int code = 0;
  try {
    char c = 'q';
    if (::read(commands, &c, 1) != 1 || c == 'q') ::_exit(0);
    at::set_num_threads(1);
    const auto job = sw::runtime::connect(sw::runtime::rendezvous_env());
    const auto dist =
        sw::distributed::Options().data_parallel(kReplicas).bucket_bytes(1 << 20).transport(
            sw::runtime::C10dOptions().prefix("distributed_cpu/pp_dp"));
    sw::distributed::Pipe pipe(job, model(), sw::balance{4, 4},
                               sw::PipeOptions().chunks(8).checkpoint(sw::Checkpoint::never), dist);
    auto [x, t] = batch();
    const auto sx = pipe->shard(x), st = pipe->shard(t);
    auto params = pipe->parameters();
    torch::Tensor loss;
    auto step = [&] {
      for (auto& p : params) p.mutable_grad() = torch::Tensor();
      loss = pipe->train_step(sx, st, mse, sw::schedule::gpipe{});
    };
    do {
      std::vector<double> answer;
      if (c == 'p') answer.push_back(median_us(step, kSteps, 2));
      if (c == 'y') {
        step();
        double grad_bytes = 0, norm2 = 0;
        for (const auto& g : params) {
          grad_bytes += static_cast<double>(g.grad().nbytes());
          norm2 += g.grad().pow(2).sum().item<double>();
        }
        answer = {static_cast<double>(pipe->bytes_reduced_last_step()), grad_bytes,
                  loss.item<double>(), std::sqrt(norm2)};
      }
      if (rank == 0) {
        [[maybe_unused]] auto n = ::write(answers, answer.data(), answer.size() * sizeof(double));
      }
    } while (::read(commands, &c, 1) == 1 && c != 'q');
  } catch (const std::exception& e) {
    std::fprintf(stderr, "2x2 rank %d: %s\n", rank, e.what());
    code = 1;
  }
  std::fflush(stdout);
  ::_exit(code);
}

// The sharded-state section's figures (zero_job.hpp), printed after the others.
struct ZeroFigures {
  double step_ratio = NAN, bytes_per_param = NAN, zero1_bytes = NAN, zero1_ratio = NAN;
  double dp_step_ratio = NAN, dp_bytes_per_param = NAN;
};

// Runs the section on the two jobs and prints its tables.
ZeroFigures sharded_section(sw::bench::zero::Job& pipe, sw::bench::zero::Job& dp) {
  namespace zero = sw::bench::zero;
  namespace bench = sw::bench;
  constexpr int kZeroRounds = 5;
  ZeroFigures f;
  // Times, alternating the variants' order round by round; each ratio within a round.
  auto rounds = [&](zero::Job& job, int variants, std::vector<std::vector<double>>& us,
                    std::vector<std::vector<double>>& ratio) {
    us.assign(static_cast<std::size_t>(variants), {});
    ratio.assign(static_cast<std::size_t>(variants), {});
    for (int round = 0; round < kZeroRounds; ++round) {
      std::vector<double> t(static_cast<std::size_t>(variants));
      for (int k = 0; k < variants; ++k) {
        const int v = (round + k) % variants;
        t[static_cast<std::size_t>(v)] = job.time(v);
      }
      for (int v = 0; v < variants; ++v) {
        us[static_cast<std::size_t>(v)].push_back(t[static_cast<std::size_t>(v)]);
        // Each against its unsharded counterpart: unfused against unfused, fused against fused.
        const int base = (v == zero::kPlain || v == zero::kSharded) ? zero::kPlain : zero::kFused;
        ratio[static_cast<std::size_t>(v)].push_back(t[static_cast<std::size_t>(v)] /
                                                     t[static_cast<std::size_t>(base)]);
      }
    }
  };
  std::vector<std::vector<double>> pipe_us, pipe_ratio, dp_us, dp_ratio;
  rounds(pipe, zero::kVariants, pipe_us, pipe_ratio);
  rounds(dp, zero::kDataParallelVariants, dp_us, dp_ratio);
  // Bytes per parameter with 32 and 8 layers per stage: the transient (a gradient being computed,
  // two buckets in flight, Adam's temporaries) is a few of the stage's largest tensors.
  std::vector<double> pipe_bytes, dp_bytes, pipe_bytes8, dp_bytes8;
  for (int v = 0; v < zero::kVariants; ++v) {
    pipe_bytes.push_back(pipe.bytes_per_param(v, zero::kMemoryLayers));
    pipe_bytes8.push_back(pipe.bytes_per_param(v, zero::kLayers));
  }
  for (int v = 0; v < zero::kDataParallelVariants; ++v) {
    dp_bytes.push_back(dp.bytes_per_param(v, zero::kMemoryLayers));
    dp_bytes8.push_back(dp.bytes_per_param(v, zero::kLayers));
  }
  std::vector<double> scatter_us;
  for (int how = 0; how < 4; ++how) scatter_us.push_back(pipe.collective(how));
  // The model-state bytes per fp32 parameter each variant holds at its peak, in theory (Adam: 8
  // of state; d = 2), beside the measurement.
  const char* theory[zero::kVariants] = {"4+4+4+8 = 20", "4+4+4+8 = 20", "4+4+8/d = 12",
                                         "4+4+8/d = 12", "4+12/d = 10"};
  const char* dp_theory[zero::kDataParallelVariants] = {"4+4+4+8 = 20", "4+4+4+8 = 20",
                                                        "4+12/d = 10", "4+12/d = 10"};
  auto table = [&](const char* title, int variants, const std::vector<std::vector<double>>& us,
                   const std::vector<std::vector<double>>& ratio, const std::vector<double>& bytes,
                   const std::vector<double>& bytes8, const char* const* formula) {
    std::printf("# %s\n", title);
    for (int v = 0; v < variants; ++v) {
      bench::print_figure(zero::kNames[v], bench::summarize(us[static_cast<std::size_t>(v)]), "us");
    }
    for (int v = 0; v < variants; ++v) {
      if (v == zero::kPlain || v == zero::kFused) continue;
      bench::print_figure(std::string(zero::kNames[v]) + ": / unsharded",
                          bench::summarize(ratio[static_cast<std::size_t>(v)]), "x");
    }
    std::printf("  %-52s %10s %10s  %s\n", "bytes per parameter at the step's peak", "32 layers",
                "8 layers", "in theory: params+grads(+buckets)+Adam");
    for (int v = 0; v < variants; ++v) {
      std::printf("  %-52s %10.2f %10.2f  %s\n", zero::kNames[v],
                  bytes[static_cast<std::size_t>(v)], bytes8[static_cast<std::size_t>(v)],
                  formula[v]);
    }
  };
  table(
      "sharded state, 2 stages x 2 replicas (4 ranks), [Linear(512,512), ReLU] layers, Adam, "
      "1F1B, 1 MiB buckets; times: 8 layers per stage, 64 rows per replica, chunks 8; bytes: 32 "
      "and 8 layers per stage, 2 micro-batches of 1 row",
      zero::kVariants, pipe_us, pipe_ratio, pipe_bytes, pipe_bytes8, theory);
  table(
      "sharded state, DataParallel on 2 ranks: the same layers (both stages), Adam, 1 MiB "
      "buckets; times: 16 layers, 64 rows per rank; bytes: 64 and 16 layers, 1 row per rank",
      zero::kDataParallelVariants, dp_us, dp_ratio, dp_bytes, dp_bytes8, dp_theory);
  std::printf("# reduce-scattering a 4 MiB bucket over 2 ranks (2 owner slices), alone\n");
  const char* ways[4] = {"reduce (one per owner, in place; default)", "all_to_all (owner sums)",
                         "all_reduce (then dropped)", "unsharded all-reduce"};
  for (int how = 0; how < 4; ++how) {
    std::printf("  %-52s %10.1f us\n", ways[how], scatter_us[static_cast<std::size_t>(how)]);
  }
  f.step_ratio = bench::summarize(pipe_ratio[zero::kZero2Fused]).median;
  f.bytes_per_param = pipe_bytes[zero::kZero2Fused];
  f.zero1_ratio = bench::summarize(pipe_ratio[zero::kShardedFused]).median;
  f.zero1_bytes = pipe_bytes[zero::kShardedFused];
  f.dp_step_ratio = bench::summarize(dp_ratio[zero::kShardedFused]).median;
  f.dp_bytes_per_param = dp_bytes[zero::kShardedFused];
  return f;
}

// The sharded section's keys, appended to the last line.
void print_zero_keys(const ZeroFigures& f) {
  std::printf(
      " zero_bytes_per_param=%.2f zero_step_ratio=%.3f zero1_bytes_per_param=%.2f "
      "zero1_step_ratio=%.3f dp_zero_bytes_per_param=%.2f dp_zero_step_ratio=%.3f\n",
      f.bytes_per_param, f.step_ratio, f.zero1_bytes, f.zero1_ratio, f.dp_bytes_per_param,
      f.dp_step_ratio);
}

}  // namespace

int main(int argc, char** argv) {
  namespace bench = sw::bench;
  bench::select_blas(argc, argv);  // may re-execute this program: before the ranks are forked
  const bool pipe_only = bench::has_flag(argc, argv, "--pipe-only");
  const bool sharded_only = bench::has_flag(argc, argv, "--sharded-only");
  // Fork the ranks first, while this process has one thread. The sharded section's jobs: 4 ranks
  // (2 x 2 pipe) and 2 (DataParallel), each on a port of its own.
  std::unique_ptr<bench::zero::Job> zero_pipe, zero_dp;
  if (!pipe_only) {
    const int a = bench::free_loopback_port("distributed_cpu");
    int b = bench::free_loopback_port("distributed_cpu");
    while (b == a) b = bench::free_loopback_port("distributed_cpu");
    zero_pipe = std::make_unique<bench::zero::Job>(true, 4, a);
    zero_dp = std::make_unique<bench::zero::Job>(false, 2, b);
  }
  if (sharded_only) {
    at::set_num_threads(1);
    bench::Conditions conditions("distributed_cpu");
    const auto z = sharded_section(*zero_pipe, *zero_dp);
    const int failed = zero_pipe->quit() + zero_dp->quit();
    conditions.print_end();
    std::printf(
        "distributed_cpu speedup_vs_sequential=nan one_f_one_b_speedup=nan ratio_vs_in_process=nan "
        "speedup_vs_torch_pipelining=nan dp_speedup=nan dp_overlap=nan pp_dp_speedup=nan "
        "clip_step_ratio=nan");
    print_zero_keys(z);
    return failed ? 1 : 0;
  }
  const int port = bench::free_loopback_port("distributed_cpu");
  int commands[2][2], answers[2];
  std::vector<pid_t> ranks;
  TORCH_CHECK(::pipe(answers) == 0, "distributed_cpu: pipe() failed");
  for (int r = 0; r < 2; ++r) {
    TORCH_CHECK(::pipe(commands[r]) == 0, "distributed_cpu: pipe() failed");
    const pid_t pid = ::fork();
    if (pid == 0) rank_main(r, port, commands[r][0], answers[1]);
    ranks.push_back(pid);
  }
  // The 2x2 pipe's job: 4 more ranks, on a port of their own.
  int replica_port = bench::free_loopback_port("distributed_cpu");
  while (replica_port == port) replica_port = bench::free_loopback_port("distributed_cpu");
  int replica_commands[2 * kReplicas][2], replica_answers[2];
  TORCH_CHECK(::pipe(replica_answers) == 0, "distributed_cpu: pipe() failed");
  for (int r = 0; r < 2 * kReplicas && !pipe_only; ++r) {
    TORCH_CHECK(::pipe(replica_commands[r]) == 0, "distributed_cpu: pipe() failed");
    const pid_t pid = ::fork();
    if (pid == 0) replica_rank_main(r, replica_port, replica_commands[r][0], replica_answers[1]);
    ranks.push_back(pid);
  }
  // Sends a command to a job's ranks and reads `n` numbers from its rank 0.
  auto ask_job = [](const std::vector<int>& to, int from, char c, std::size_t n) {
    for (const int fd : to) {
      TORCH_CHECK(::write(fd, &c, 1) == 1, "distributed_cpu: a rank is gone");
    }
    std::vector<double> answer(n, NAN);
    auto* bytes = reinterpret_cast<char*>(answer.data());
    for (std::size_t got = 0; got < n * sizeof(double);) {
      const auto k = ::read(from, bytes + got, n * sizeof(double) - got);
      TORCH_CHECK(k > 0, "distributed_cpu: rank 0 did not answer (see its error above)");
      got += static_cast<std::size_t>(k);
    }
    return answer;
  };
  const std::vector<int> to_pipe{commands[0][1], commands[1][1]};
  std::vector<int> to_replicas;
  for (int r = 0; r < 2 * kReplicas && !pipe_only; ++r)
    to_replicas.push_back(replica_commands[r][1]);
  auto ask = [&](char c) { return ask_job(to_pipe, answers[0], c, 1)[0]; };

  at::set_num_threads(1);
  bench::Conditions conditions("distributed_cpu");
  std::printf(
      "# distributed_cpu: 2 stages of Linear(512,512), ReLU, Linear(512,512), ReLU; batch "
      "128, chunks 8; forward+backward per step; %d rounds, median of %d steps each\n",
      kRounds, kSteps);

  auto seq = model();
  auto in_process = sw::Pipe(model(), sw::balance{4, 4},
                             sw::PipeOptions().chunks(8).checkpoint(sw::Checkpoint::never));
  auto [x, t] = batch();
  const char* names[] = {"sequential (micro-batched, 1 thread)", "in-process pipe, gpipe",
                         "distributed, gpipe", "distributed, 1F1B"};
  auto run = [&](int variant) {
    switch (variant) {
      case 0:
        return median_us(
            [&] {
              seq->zero_grad();
              auto xs = x.chunk(8), ts = t.chunk(8);
              for (std::size_t i = 0; i < xs.size(); ++i) {
                (mse(seq->forward(xs[i]), ts[i]) * (double(xs[i].size(0)) / double(x.size(0))))
                    .backward();
              }
            },
            kSteps, 2);
      case 1:
        return median_us(
            [&] {
              in_process->zero_grad();
              in_process->train_step(x, t, mse, sw::schedule::gpipe{});
            },
            kSteps, 2);
      case 2:
        return ask('g');
      default:
        return ask('o');
    }
  };
  // Rounds alternate the variants' order; each ratio is taken within a round.
  std::vector<std::vector<double>> times(4);
  std::vector<double> vs_sequential, ofob_vs_sequential, vs_in_process;
  for (int round = 0; round < kRounds; ++round) {
    double us[4];
    for (int k = 0; k < 4; ++k) {
      const int v = (round + k) % 4;
      us[v] = run(v);
      times[static_cast<std::size_t>(v)].push_back(us[v]);
    }
    vs_sequential.push_back(us[0] / us[2]);
    ofob_vs_sequential.push_back(us[0] / us[3]);
    vs_in_process.push_back(us[1] / us[2]);
  }
  const double agreement_us = ask('e');
  // The clipped fused step against the unclipped one, alternating; each ratio within a round.
  std::vector<double> fused_us, clipped_us, clip_ratios;
  for (int round = 0; round < kRounds; ++round) {
    double u[2] = {};
    for (int k = 0; k < 2; ++k) {
      if ((round + k) % 2 == 0) {
        u[0] = ask('f');
      } else {
        u[1] = ask('c');
      }
    }
    fused_us.push_back(u[0]);
    clipped_us.push_back(u[1]);
    clip_ratios.push_back(u[1] / u[0]);
  }
  const auto clip_ratio = bench::summarize(clip_ratios);
  const double gather_us = ask('x');
  // Sends every rank 'q' and reaps them all; the number that did not exit cleanly.
  auto quit = [&] {
    for (const int fd : to_pipe) {
      const char q = 'q';
      [[maybe_unused]] auto n = ::write(fd, &q, 1);
    }
    for (const int fd : to_replicas) {
      const char q = 'q';
      [[maybe_unused]] auto n = ::write(fd, &q, 1);
    }
    int failed = 0;
    for (auto pid : ranks) {
      int status = 0;
      ::waitpid(pid, &status, 0);
      failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    return failed;
  };
  const auto speedup = bench::summarize(vs_sequential);
  const auto ofob = bench::summarize(ofob_vs_sequential);
  const auto ratio = bench::summarize(vs_in_process);
  const double gpipe_us = bench::summarize(times[2]).median;
  // The first table: the rounds above, and torch.distributed.pipelining's step.
  auto print_pipes = [&](const bench::Summary& torch_us) {
    std::printf("  %-52s %10s  [min, max]\n", "variant", "median");
    for (int v = 0; v < 4; ++v) {
      bench::print_figure(names[v], bench::summarize(times[static_cast<std::size_t>(v)]), "us");
    }
    bench::print_figure("torch.distributed.pipelining GPipe (2 processes)", torch_us, "us");
    bench::print_figure("distributed gpipe: speed-up vs sequential", speedup, "x");
    bench::print_figure("distributed 1F1B: speed-up vs sequential", ofob, "x");
    bench::print_figure("in-process time / distributed time (gpipe)", ratio, "x");
    // Every train_step ends with it; timed alone (median of 200) after the rounds.
    std::printf("  %-52s %10.1f us  (%.3f%% of the gpipe step)\n",
                "end-of-step agreement (end_step), per step", agreement_us,
                100.0 * agreement_us / gpipe_us);
    std::printf("# the clipped step: pipe->clip_grad_norm_step(fused SGD, gpipe step, max_norm %g) "
                "against the same fused step unclipped, %d rounds\n",
                kClipNorm, kRounds);
    bench::print_figure("distributed, gpipe, fused SGD step", bench::summarize(fused_us), "us");
    bench::print_figure("the same, clipped (norm pass + update pass)",
                        bench::summarize(clipped_us), "us");
    bench::print_figure("clipped / unclipped step", clip_ratio, "x");
    // Timed alone (median of 200) after the rounds: a clip whose closure runs nothing.
    std::printf("  %-52s %10.1f us\n", "the clip's norm gather alone (empty closure)", gather_us);
  };
  if (pipe_only) {
    const int failed = quit();
    print_pipes(bench::Summary{});
    conditions.print_end();
    std::printf(
        "distributed_cpu speedup_vs_sequential=%.2f one_f_one_b_speedup=%.2f "
        "ratio_vs_in_process=%.2f speedup_vs_torch_pipelining=nan dp_speedup=nan "
        "dp_overlap=nan pp_dp_speedup=nan clip_step_ratio=%.3f",
        speedup.median, ofob.median, ratio.median, clip_ratio.median);
    print_zero_keys(ZeroFigures{});
    return failed ? 1 : 0;
  }
  // Data parallel against one process on the whole batch, alternating in rounds.
  auto whole = model();
  auto one_process = [&] {
    whole->zero_grad();
    mse(whole->forward(x), t).backward();
  };
  std::vector<double> one_us, dp_us, local_us, reduce_us, dp_speedups, overlaps;
  for (int round = 0; round < kRounds; ++round) {
    double u[4] = {};
    for (int k = 0; k < 4; ++k) {
      switch ((round + k) % 4) {
        case 0:
          u[0] = median_us(one_process, kSteps, 2);
          break;
        case 1:
          u[1] = ask('d');
          break;
        case 2:
          u[2] = ask('n');
          break;
        default:
          u[3] = ask('r');
      }
    }
    one_us.push_back(u[0]);
    dp_us.push_back(u[1]);
    local_us.push_back(u[2]);
    reduce_us.push_back(u[3]);
    dp_speedups.push_back(u[0] / u[1]);
    overlaps.push_back(std::clamp(1.0 - (u[1] - u[2]) / u[3], 0.0, 1.0));
  }
  const double dp_bytes = ask('b');
  double grad_bytes = 0;
  for (const auto& p : whole->parameters()) grad_bytes += static_cast<double>(p.nbytes());
  // Pipeline x data parallel: the 2x2 pipe's GPipe step (each replica on its 64 rows) against
  // the one-replica pipe's on the whole batch, alternating; each ratio within a round. The 2x2
  // job starts at its first command (not timed: median_us warms up first).
  std::vector<double> one_replica_us, pp_dp_us, pp_dp_speedups;
  for (int round = 0; round < kRounds; ++round) {
    double u[2] = {};
    for (int k = 0; k < 2; ++k) {
      if ((round + k) % 2 == 0) {
        u[0] = ask('g');
      } else {
        u[1] = ask_job(to_replicas, replica_answers[0], 'p', 1)[0];
      }
    }
    one_replica_us.push_back(u[0]);
    pp_dp_us.push_back(u[1]);
    pp_dp_speedups.push_back(u[0] / u[1]);
  }
  // bytes all-reduced, stage 0's gradient bytes, loss, stage 0's gradient norm
  const auto pp_dp_step = ask_job(to_replicas, replica_answers[0], 'y', 4);
  const auto one_replica_step = ask_job(to_pipe, answers[0], 'l', 2);  // loss, gradient norm
  const int failed = quit();
  // The system's python3 if its torch has the module, else a Debian 13 root's (as pipe_cpu).
  // Only configuration (d)'s GPipe step is read here: running the anchor's overhead
  // configuration and its 1F1B probe too took it past run_anchor's 600 s limit. That step
  // (about 50 s) sometimes hangs on Gloo: each launch gets 150 s, and two relaunches.
  const auto anchor =
      bench::run_anchor("benchmarks/anchors/torch_pipelining.py", "torch.distributed.pipelining",
                        "--configs d --no-one-f-one-b --timeout 150 --retries 2");
  const bench::Summary torch_us{bench::value_or_nan(anchor, "torch_pipelining_min_us"),
                                bench::value_or_nan(anchor, "torch_pipelining_us"),
                                bench::value_or_nan(anchor, "torch_pipelining_max_us")};

  print_pipes(torch_us);
  std::printf(
      "# data parallel: the whole model on each of 2 ranks, 64 rows each, buckets of 1 MiB\n");
  bench::print_figure("one process, whole batch (128 rows)", bench::summarize(one_us), "us");
  bench::print_figure("DataParallel, 2 ranks", bench::summarize(dp_us), "us");
  bench::print_figure("DataParallel, 2 ranks, no communication (no_sync)",
                      bench::summarize(local_us), "us");
  bench::print_figure("the step's all-reduces alone", bench::summarize(reduce_us), "us");
  const auto dp_speedup = bench::summarize(dp_speedups);
  const auto dp_overlap = bench::summarize(overlaps);
  bench::print_figure("DataParallel: speed-up vs one process", dp_speedup, "x");
  bench::print_figure("share of the all-reduces hidden behind backward", dp_overlap, "");
  // d = 2: the ring all-reduce moves 2(d-1)/d = 1 x the gradients per rank.
  std::printf("  %-52s %10.0f B  (gradients %.0f B; ring all-reduce 2(d-1)/d x = %.0f B)\n",
              "bytes all-reduced per rank and step", dp_bytes, grad_bytes, grad_bytes);
  std::printf(
      "# pipeline x data parallel: 2 stages x %d replicas on %d ranks (rank r: stage r %% 2 of "
      "replica r / 2), %d rows and chunks 8 per replica, buckets of 1 MiB, gpipe; against the "
      "one-replica pipe on 2 ranks and 128 rows; %d rounds\n",
      kReplicas, 2 * kReplicas, 128 / kReplicas, kRounds);
  bench::print_figure("one replica: 2 stages on 2 ranks, 128 rows",
                      bench::summarize(one_replica_us), "us");
  bench::print_figure("2 stages x 2 replicas on 4 ranks, 64 rows each", bench::summarize(pp_dp_us),
                      "us");
  const auto pp_dp_speedup = bench::summarize(pp_dp_speedups);
  bench::print_figure("2x2: speed-up vs one replica", pp_dp_speedup, "x");
  // Per rank, of its stage's gradients (rank 0: stage 0); d = 2 replicas.
  const double stage_bytes = pp_dp_step[1];
  std::printf("  %-52s %10.0f B  (stage gradients %.0f B; ring all-reduce 2(d-1)/d x = %.0f B)\n",
              "bytes all-reduced per rank and step (2x2)", pp_dp_step[0], stage_bytes,
              2.0 * (kReplicas - 1) / kReplicas * stage_bytes);
  // The same model and global batch: the 2x2 pipe's mean loss and averaged gradients should be
  // the one-replica pipe's (rounding aside).
  std::printf("  %-52s %10.1e  (stage 0's gradient norm: %.1e)\n",
              "2x2 vs one replica: relative difference of the loss",
              std::abs(pp_dp_step[2] - one_replica_step[0]) / std::abs(one_replica_step[0]),
              std::abs(pp_dp_step[3] - one_replica_step[1]) / std::abs(one_replica_step[1]));
  // Last, alone on the machine: the sharded-state section.
  const auto zero = sharded_section(*zero_pipe, *zero_dp);
  const int zero_failed = zero_pipe->quit() + zero_dp->quit();
  conditions.print_end();
  std::printf(
      "distributed_cpu speedup_vs_sequential=%.2f one_f_one_b_speedup=%.2f "
      "ratio_vs_in_process=%.2f speedup_vs_torch_pipelining=%.2f dp_speedup=%.2f "
      "dp_overlap=%.2f pp_dp_speedup=%.2f clip_step_ratio=%.3f",
      speedup.median, ofob.median, ratio.median, torch_us.median / gpipe_us, dp_speedup.median,
      dp_overlap.median, pp_dp_speedup.median, clip_ratio.median);
  print_zero_keys(zero);
  return failed + zero_failed ? 1 : 0;
}
