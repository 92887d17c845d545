// gpt: a byte-level decoder-only transformer (examples/gpt/model.hpp) trained on the text of
// Debian's `fortunes` package, split into pipeline stages by measured time. The RoPE tables, the
// causal mask and the int64 token ids are made in stage 0 and reach every block's stage as skips.
// AdamW is fused into backward, with gradient clipping by the whole model's norm; --bf16 or, on
// CUDA, --fp16 (autocast with an amp::GradScaler) train in lower precision.
//   ./bazelw run //examples:gpt                 (one process, 2 stages; --small: a smaller model)
//   ./bazelw build //examples:gpt && tools/launch -n 2 -- bazel-bin/examples/gpt
// Writes to --out: loss.svg, timeline.svg, losses.csv, gpt.pt and gpt.safetensors (load them in
// Python: docs/gpt.md), and a save per --save-every steps (ckpt-<step>/, used by --resume).
#include "examples/gpt/data.hpp"
#include "examples/gpt/export.hpp"
#include "examples/gpt/flags.hpp"
#include "examples/gpt/model.hpp"
#include "examples/gpt/plot.hpp"
#include "examples/gpt/sample.hpp"
#include "examples/gpt/saves.hpp"

#include <stagewise/distributed.hpp>
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

namespace sw = stagewise;

// Trains `pipe` (one process or this rank's stages) as the flags say; returns the exit code.
template <class PipeT>
int train(PipeT& pipe, const gpt::Flags& f, const gpt::Corpus& corpus, int rank, int ranks) {
  namespace fs = std::filesystem;
  const bool lead = rank == 0;
  sw::optim::FusedStep fused(pipe->named_parameters(),
                             torch::optim::AdamWOptions(f.lr).weight_decay(0.01));
  // Disabled (a no-op) unless --fp16: then each micro-batch's loss is scaled, and a step whose
  // gradients overflow is skipped on every rank.
  sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().enabled(f.fp16));
  std::vector<gpt::LossPoint> log;
  int64_t first = 0;
  if (f.resume) {
    const auto dir = gpt::latest_save(f.out);
    TORCH_CHECK(!dir.empty(), "gpt: --resume found no save in ", f.out,
                " (a complete ckpt-<step>/); run without --resume first");
    first = pipe->load(dir, fused, scaler) + 1;
    log = gpt::read_losses(f.out + "/losses.csv", first);
    if (lead) std::printf("resumed from %s at step %lld\n", dir.c_str(), (long long)first);
  }
  auto [vx, vy] = gpt::valid_batch(corpus, 32, f.model.context);
  auto valid_loss = [&] {  // a plain train_step with the fused step detached: nothing steps
    fused.detach();
    auto loss = pipe->train_step(vx, vy, gpt::lm_loss, sw::schedule::one_f_one_b{});
    for (auto& p : pipe->parameters()) p.mutable_grad().reset();
    fused.attach();
    return loss.template item<double>();
  };
  if (f.bf16) gpt::set_bf16_autocast(f.device, true);
  if (f.fp16) gpt::set_fp16_autocast(true);
  sw::schedule::Timeline timeline;
  double seconds = 0;
  int64_t tokens = 0;
  for (int64_t step = first; step < f.steps; ++step) {
    auto [x, y] = gpt::train_batch(corpus, step, f.batch, f.model.context, f.seed + 1);
    const bool last = step + 1 == f.steps;
    torch::Tensor loss;
    auto run = [&] {
      sw::schedule::Timeline* t = last ? &timeline : nullptr;
      loss = f.schedule == "zb" ? pipe->train_step(x, y, gpt::lm_loss, fused, scaler,
                                                   sw::schedule::zero_bubble_h1{}, t)
                                : pipe->train_step(x, y, gpt::lm_loss, fused, scaler,
                                                   sw::schedule::one_f_one_b{}, t);
    };
    const auto start = std::chrono::steady_clock::now();
    double norm = -1;
    if (f.clip > 0) {
      // The whole model's norm, also on a distributed pipe (every rank's stages).
      norm = pipe->clip_grad_norm_step(fused, run, f.clip, scaler).total_norm;
    } else {
      run();
    }
    scaler.update();
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    tokens += x.numel();
    gpt::LossPoint point{step, loss.item<double>(), -1};
    if (step % f.eval_every == 0 || last) {
      point.valid = valid_loss();
      if (lead) {
        std::printf("step %4lld  train %.4f  valid %.4f  grad norm %.3f  %.0f tokens/s\n",
                    (long long)step, point.train, point.valid, norm, double(tokens) / seconds);
        if (f.fp16) std::printf("           loss scale %g\n", scaler.get_scale());
        std::fflush(stdout);
      }
    }
    log.push_back(point);
    if ((step + 1) % f.save_every == 0 || last) {
      pipe->save(f.out + "/ckpt-" + std::to_string(step), fused, scaler, step);
      if (lead) gpt::write_losses(f.out + "/losses.csv", log);
    }
  }
  if (f.bf16) gpt::set_bf16_autocast(f.device, false);  // the probe and sample in fp32
  if (f.fp16) gpt::set_fp16_autocast(false);
  // Each rank writes its stages' weights; the save above returned on every rank only once all
  // had saved, so it also orders this. The lead rank gathers the parts into one model.
  const auto part = gpt::to_pickle(gpt::named_tensors(*pipe, /*drop_prefix=*/true));
  gpt::write_bytes(f.out + "/weights.part" + std::to_string(rank), part.data(), part.size());
  pipe->save(f.out + "/final", fused, scaler, f.steps - 1);  // every rank returns when all parts exist
  if (!lead) return 0;
  gpt::NamedTensors all;
  for (int r = 0; r < ranks; ++r) {
    const auto path = f.out + "/weights.part" + std::to_string(r);
    all.merge(gpt::from_pickle(gpt::read_bytes(path)));
    fs::remove(path);
  }
  gpt::export_weights(all, f.out + "/gpt");
  gpt::write_text(f.out + "/loss.svg", gpt::loss_svg(log, "gpt on fortunes: loss per step"));
  sw::schedule::write_svg(timeline, f.out + "/timeline.svg");
  if (seconds > 0) {
    std::printf("trained steps %lld..%lld: %.0f tokens/s (%s, %lld stages, chunks %lld, clip %g)\n",
                (long long)first, (long long)f.steps - 1, double(tokens) / seconds,
                f.schedule.c_str(), (long long)f.stages, (long long)f.chunks, f.clip);
  }
  if (!log.empty()) {
    std::printf("final train loss %.4f, validation loss %.4f\n", log.back().train, log.back().valid);
  }
  auto cpu_model = gpt::make_model(f.model);
  gpt::load_weights(*cpu_model, all);
  gpt::write_probe(cpu_model, vx.narrow(0, 0, 2), f.out + "/gpt_probe.pt");
  std::printf("sample: %s\n", gpt::generate(cpu_model, f.model, 200, f.seed).c_str());
  std::printf("wrote %s/{gpt.pt, gpt.safetensors, gpt_probe.pt, loss.svg, timeline.svg}\n",
              f.out.c_str());
  if (f.expect_valid > 0 && !(log.back().valid < f.expect_valid)) {
    std::printf("FAILED: validation loss %.4f is not below --expect-valid=%g\n", log.back().valid,
                f.expect_valid);
    return 1;
  }
  return 0;
}

int main(int argc, char** argv) try {
  const auto f = gpt::parse_flags(argc, argv);
  std::filesystem::create_directories(f.out);
  at::set_num_threads(1);  // one core per stage: the pipeline is the parallelism
  const auto corpus = gpt::load_corpus(f.data);
  torch::manual_seed(static_cast<int64_t>(f.seed));  // every rank builds the same model
  auto model = gpt::make_model(f.model);
  auto options = sw::PipeOptions().chunks(f.chunks).checkpoint(f.checkpoint);
  auto sample = gpt::train_batch(corpus, 0, std::max<int64_t>(1, f.batch / f.chunks),
                                 f.model.context).first;
  if (std::getenv("WORLD_SIZE") != nullptr) {
    // Every rank must split the model alike: by activation size (the same on every rank), not
    // by measured time (which differs from rank to rank).
    gpt::check_fp16(f, {});  // its stages are on the CPU
    const auto b = sw::balance_by_size(f.stages, model, sample);
    sw::distributed::Pipe pipe(model, b, options);
    return train(pipe, f, corpus, pipe->rank(), pipe->world_size());
  }
  options.devices(sw::place_stages(static_cast<std::size_t>(f.stages), f.device));
  gpt::check_fp16(f, options.devices());
  sw::balance b;
  if (f.resume) {
    const auto saved = gpt::read_balance(f.out);
    b.assign(saved.begin(), saved.end());
  } else {
    b = sw::balance_by_time(f.stages, model, sample,
                            sw::BalanceOptions().device(options.devices()[0]));
    gpt::write_balance(f.out, b);
  }
  std::printf("balance by time:");
  for (auto n : b) std::printf(" %lld", (long long)n);
  std::printf(" layers over %lld stages on %s\n", (long long)f.stages,
              options.devices()[0].str().c_str());
  auto pipe = sw::Pipe(model, b, options);
  return train(pipe, f, corpus, 0, 1);
} catch (const c10::Error& e) {
  std::fprintf(stderr, "%s\n", e.what_without_backtrace());
  return 2;
} catch (const std::exception& e) {
  std::fprintf(stderr, "%s\n", e.what());
  return 2;
}
