// Optimizer state off the device (runtime::OffloadedState): with the fused step and with the
// unfused optim::OffloadedOptimizer, in a HostStore and in a FileStore, whole or a share, the
// parameters after 10 steps equal the plain optimizer's bit for bit; a store that fails on any of
// its writes fails the step and changes nothing; saves read and load alike with or without it.
#include "tests/optim/test_models.hpp"

#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace sw = stagewise;
namespace optim = torch::optim;
namespace fs = std::filesystem;
using sw::testing::contains;
using sw::testing::error_of;
using test::Net;
using test::NetConfig;

namespace {

// A directory of its own, removed afterwards.
struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& name)
      : path(fs::temp_directory_path() / ("stagewise_" + name + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  std::vector<std::string> files() const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(path)) out.push_back(e.path().filename().string());
    return out;
  }
};

// A HostStore whose n-th write of optimizer state fails (0: none), as a store that fills would.
struct FailingStore {
  sw::runtime::HostStore inner;
  std::shared_ptr<std::atomic<int>> writes = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<int> fail_at = std::make_shared<int>(0);
  std::optional<sw::optim::StateRecord> read_state(const std::string& key) {
    return inner.read_state(key);
  }
  void write_state(const std::string& key, sw::optim::StateRecord record) {
    const int n = writes->fetch_add(1) + 1;
    TORCH_CHECK(n != *fail_at, "FailingStore: write ", n, " of '", key, "' failed (full)");
    inner.write_state(key, std::move(record));
  }
  void commit_state() { inner.commit_state(); }
  void discard_state() { inner.discard_state(); }
  std::string describe() const { return "FailingStore"; }
};
static_assert(sw::runtime::state_store<FailingStore>);
static_assert(!sw::runtime::offload_store<FailingStore>);

std::vector<torch::Tensor> values(const Net& net) {
  std::vector<torch::Tensor> out;
  for (const auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

bool equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

// `steps` fused steps with the state in `store` (share of the bytes).
template <class Options>
Net train_fused_offloaded(Options options, sw::runtime::AnyStore store, double share, NetConfig cfg,
                          int steps = 10) {
  auto net = test::make_net(cfg);
  sw::optim::FusedStep fused(net->named_parameters(), options);
  fused.offload_state(sw::runtime::OffloadedState(store, share));
  fused.set_accumulation_steps(cfg.micro_batches);
  for (int s = 0; s < steps; ++s) {
    test::forward_backward(net, s);
    fused.finish_step();
    for (const auto& p : net->parameters()) REQUIRE_FALSE(p.grad().defined());
  }
  for (std::size_t i = 0; i < fused.size(); ++i) {
    if (fused.offloaded(i)) CHECK(fused.optimizer(i).state().empty());  // none on the device
  }
  return net;
}

// `steps` unfused steps of an OffloadedOptimizer.
template <class Options>
Net train_unfused_offloaded(Options options, sw::runtime::AnyStore store, double share,
                            NetConfig cfg, int steps = 10) {
  auto net = test::make_net(cfg);
  sw::optim::OffloadedOptimizer opt(net->named_parameters(), options,
                                    sw::runtime::OffloadedState(store, share));
  for (int s = 0; s < steps; ++s) {
    test::forward_backward(net, s);
    opt.step();
    opt.zero_grad();
  }
  return net;
}

template <class Options>
void check_every_store(Options options, NetConfig cfg = {}) {
  const auto want = values(test::train_unfused(options, cfg));
  TempDir dir("offloaded_state");
  for (double share : {1.0, 0.5}) {
    CAPTURE(share);
    CHECK(
        equal(values(train_fused_offloaded(options, sw::runtime::HostStore(), share, cfg)), want));
    CHECK(equal(values(train_unfused_offloaded(options, sw::runtime::HostStore(), share, cfg)),
                want));
    CHECK(equal(values(train_fused_offloaded(options, sw::runtime::FileStore(dir.path.string()),
                                             share, cfg)),
                want));
    CHECK(equal(values(train_unfused_offloaded(options, sw::runtime::FileStore(dir.path.string()),
                                               share, cfg)),
                want));
  }
  CHECK(dir.files().empty());  // a FileStore's state files go with it
}

}  // namespace

TEST_SUITE("optimizer state off the device") {
  TEST_CASE("a share keeps whole tensors, largest first") {
    CHECK(sw::optim::choose_offloaded({4096, 64, 4096, 64}, 0.5) ==
          std::vector<bool>{true, true, false, false});
    CHECK(sw::optim::choose_offloaded({10, 30, 20}, 1.0) == std::vector<bool>{true, true, true});
    CHECK(sw::optim::choose_offloaded({10, 30, 20}, 0.0) == std::vector<bool>{false, false, false});
    CHECK(sw::optim::choose_offloaded({10, 30, 20}, 0.7) == std::vector<bool>{true, true, false});
    CHECK(contains(error_of([] { (void)sw::optim::choose_offloaded({1}, 1.5); }),
                   "the share is 1.5; give a share of the bytes from 0 (none) to 1 (all)"));
    auto net = test::make_net({});
    sw::optim::FusedStep fused(net->named_parameters(), optim::AdamOptions(1e-3));
    sw::runtime::OffloadedState offloaded(sw::runtime::HostStore(), 0.5);
    fused.offload_state(std::move(offloaded));
    // a: 16x6 + 16, b: 16x16 + 16, c: 3x16 + 3 floats: b.weight (1024 of 1740 bytes) is more
    // than half, and every other one fits in it.
    std::vector<bool> held;
    for (std::size_t i = 0; i < fused.size(); ++i) held.push_back(fused.offloaded(i));
    CHECK(held == std::vector<bool>{true, true, false, true, true, true});
  }

  TEST_CASE("Adam, AdamW, SGD with momentum, RMSprop and Adagrad equal the plain optimizer") {
    check_every_store(optim::AdamOptions(1e-2).weight_decay(1e-3));
    check_every_store(optim::AdamOptions(1e-2).amsgrad(true), {.micro_batches = 2});
    check_every_store(optim::AdamWOptions(1e-2));
    check_every_store(optim::SGDOptions(0.1).momentum(0.9).nesterov(true), {.micro_batches = 2});
    check_every_store(optim::RMSpropOptions(1e-2).momentum(0.5).centered(true));
    check_every_store(optim::AdagradOptions(0.1).initial_accumulator_value(0.1));
  }

  TEST_CASE("clipping by the whole model's norm, fused and unfused") {
    const NetConfig cfg{.micro_batches = 2};
    auto want = test::make_net(cfg);
    {
      optim::Adam adam(want->parameters(), optim::AdamOptions(1e-2));
      for (int s = 0; s < 6; ++s) {
        test::forward_backward(want, s);
        torch::nn::utils::clip_grad_norm_(want->parameters(), 0.05);
        adam.step();
        adam.zero_grad();
      }
    }
    auto fused_net = test::make_net(cfg);
    sw::optim::FusedStep fused(fused_net->named_parameters(), optim::AdamOptions(1e-2));
    fused.offload_state(sw::runtime::OffloadedState(sw::runtime::HostStore()));
    fused.set_accumulation_steps(2);
    auto unfused_net = test::make_net(cfg);
    sw::optim::OffloadedOptimizer unfused(unfused_net->named_parameters(), optim::AdamOptions(1e-2),
                                          sw::runtime::OffloadedState(sw::runtime::HostStore()));
    for (int s = 0; s < 6; ++s) {
      auto r = sw::optim::clip_grad_norm_step(
          fused, [&] { test::forward_backward(fused_net, s); }, 0.05);
      CHECK(r.stepped);
      test::forward_backward(unfused_net, s);
      torch::nn::utils::clip_grad_norm_(unfused_net->parameters(), 0.05);
      unfused.step();
      unfused.zero_grad();
    }
    CHECK(equal(values(fused_net), values(want)));
    CHECK(equal(values(unfused_net), values(want)));
  }

  TEST_CASE("a GradScaler's skipped step changes no parameter and no state, fused or not") {
    // Steps 0 and 2 are finite, step 1 overflows: the scaler skips it.
    auto run = [](bool offload, bool fused_step) {
      auto net = test::make_net({});
      sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().init_scale(1024.0));
      std::unique_ptr<sw::optim::FusedStep> fused;
      std::unique_ptr<optim::Optimizer> unfused;
      if (fused_step) {
        fused = std::make_unique<sw::optim::FusedStep>(net->named_parameters(),
                                                       optim::AdamOptions(1e-2));
        if (offload) fused->offload_state(sw::runtime::OffloadedState(sw::runtime::HostStore()));
      } else if (offload) {
        unfused = std::make_unique<sw::optim::OffloadedOptimizer>(
            net->named_parameters(), optim::AdamOptions(1e-2),
            sw::runtime::OffloadedState(sw::runtime::HostStore()));
      } else {
        unfused = std::make_unique<optim::Adam>(net->parameters(), optim::AdamOptions(1e-2));
      }
      std::vector<torch::Tensor> before_skip, after_skip;
      for (int s = 0; s < 3; ++s) {
        auto loss = [&] {
          torch::manual_seed(3 + s);
          auto out = net->forward(torch::randn({8, 6}));
          if (s == 1) out = out * std::numeric_limits<float>::infinity();
          return torch::mse_loss(out, torch::zeros({8, 3}));
        };
        if (s == 1) before_skip = values(net);
        bool stepped = false;
        if (fused) {
          stepped = scaler.step(*fused, loss);
        } else {
          scaler.scale(loss()).backward();
          stepped = scaler.step(*unfused);
          unfused->zero_grad();
        }
        CHECK(stepped == (s != 1));
        scaler.update();
        if (s == 1) after_skip = values(net);
      }
      CHECK(equal(before_skip, after_skip));
      return values(net);
    };
    CHECK(equal(run(true, true), run(false, true)));
    CHECK(equal(run(true, false), run(false, false)));
  }

  TEST_CASE("a store that fails on any write fails the step and changes nothing") {
    // Each write of the step (one per parameter with state) fails in turn; the step after, with
    // the store working again, continues as if the failed one had never been tried.
    const auto want = values(test::train_unfused(optim::AdamOptions(1e-2), {}, 3));
    for (int n = 1; n <= 6; ++n) {
      CAPTURE(n);
      for (bool fused_step : {true, false}) {
        CAPTURE(fused_step);
        FailingStore store;
        auto net = test::make_net({});
        std::unique_ptr<sw::optim::FusedStep> fused;
        std::unique_ptr<sw::optim::OffloadedOptimizer> unfused;
        if (fused_step) {
          fused = std::make_unique<sw::optim::FusedStep>(net->named_parameters(),
                                                         optim::AdamOptions(1e-2));
          fused->offload_state(sw::runtime::OffloadedState(store));
        } else {
          unfused = std::make_unique<sw::optim::OffloadedOptimizer>(
              net->named_parameters(), optim::AdamOptions(1e-2),
              sw::runtime::OffloadedState(store));
        }
        auto step = [&](int s) {
          test::forward_backward(net, s);
          if (fused) {
            fused->finish_step();
          } else {
            unfused->step();
            unfused->zero_grad();
          }
        };
        step(0);
        const auto before = values(net);
        *store.fail_at = store.writes->load() + n;
        const auto e = error_of([&] { step(1); });
        CAPTURE(e);
        CHECK(contains(e,
                       "stagewise::runtime::OffloadedState in FailingStore: the host step of "
                       "parameter '"));
        CHECK(contains(e,
                       "' failed, so no parameter and no optimizer state changed in this "
                       "step: FailingStore: write "));
        CHECK(equal(values(net), before));
        if (fused) {
          for (const auto& p : net->parameters()) CHECK_FALSE(p.grad().defined());
        } else {
          unfused->zero_grad();
        }
        *store.fail_at = 0;
        step(1);
        step(2);
        CHECK(equal(values(net), want));
      }
    }
  }

  TEST_CASE("a FileStore that fills mid-step names the file and loses nothing") {
    // RLIMIT_FSIZE stands for a full disk: while it is 1 KiB, writing a state of 4 KiB fails
    // (EFBIG) after 1024 bytes; the biases' small states are written, then dropped.
    auto make = [] {
      torch::manual_seed(7);
      return torch::nn::Sequential(torch::nn::Linear(32, 32), torch::nn::Tanh(),
                                   torch::nn::Linear(32, 4));
    };
    auto step = [](torch::nn::Sequential& m, sw::optim::FusedStep& f, int s) {
      torch::manual_seed(100 + s);
      torch::mse_loss(m->forward(torch::randn({8, 32})), torch::randn({8, 4})).backward();
      f.finish_step();
    };
    auto want = make();
    sw::optim::FusedStep plain(want->named_parameters(), optim::AdamOptions(1e-2));
    for (int s = 0; s < 3; ++s) step(want, plain, s);
    TempDir dir("state_fills");
    auto model = make();
    sw::optim::FusedStep fused(model->named_parameters(), optim::AdamOptions(1e-2));
    fused.offload_state(sw::runtime::OffloadedState(sw::runtime::FileStore(dir.path.string())));
    step(model, fused, 0);
    const auto files = dir.files();
    CHECK(files.size() == 4);
    std::vector<torch::Tensor> before;
    for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
    std::string e;
    {
      rlimit old{};
      ::getrlimit(RLIMIT_FSIZE, &old);
      auto handler = std::signal(SIGXFSZ, SIG_IGN);
      rlimit small = old;
      small.rlim_cur = 1024;
      ::setrlimit(RLIMIT_FSIZE, &small);
      e = error_of([&] { step(model, fused, 1); });
      ::setrlimit(RLIMIT_FSIZE, &old);
      std::signal(SIGXFSZ, handler);
    }
    CHECK(contains(e,
                   "the host step of parameter '0.weight' failed, so no parameter and no "
                   "optimizer state changed in this step: stagewise::FileStore('" +
                       dir.path.string() + "'): writing 4096 bytes of the optimizer state of '"));
    CHECK(contains(e,
                   ".next' failed after 1024 (File too large); free space on that disk or "
                   "give FileStore a directory on one with room"));
    CHECK(dir.files().size() == files.size());  // the step's new files are gone
    for (std::size_t i = 0; i < before.size(); ++i) {
      CHECK(torch::equal(model->parameters()[i], before[i]));
    }
    step(model, fused, 1);
    step(model, fused, 2);
    for (std::size_t i = 0; i < before.size(); ++i) {
      CHECK(torch::equal(model->parameters()[i], want->parameters()[i]));
    }
  }

  TEST_CASE("a step that is not finished is refused before anything steps twice") {
    auto net = test::make_net({});
    sw::optim::FusedStep fused(net->named_parameters(), optim::SGDOptions(0.1).momentum(0.9));
    fused.offload_state(sw::runtime::OffloadedState(sw::runtime::HostStore()));
    test::forward_backward(net, 0);  // no finish_step()
    const auto e = error_of([&] { test::forward_backward(net, 1); });
    CHECK(contains(e, "stagewise::optim::FusedStep: parameter 'c."));
    CHECK(contains(e,
                   "got its last gradient of a step again before the step ended; its state is "
                   "offloaded (runtime::OffloadedState in HostStore (pinned host memory)), "
                   "which updates it only when the step ends: call fused.finish_step() after "
                   "each step's backward passes"));
    fused.reset_step();
    CHECK(contains(error_of([&] {
                     fused.offload_state(sw::runtime::OffloadedState(sw::runtime::HostStore()));
                   }),
                   "the state is offloaded already (runtime::OffloadedState in HostStore"));
    auto other = test::make_net({});
    CHECK(contains(error_of([&] {
                     sw::optim::FusedStep f(net->parameters(), optim::AdamOptions(1e-3));
                     f.offload_state(
                         sw::runtime::OffloadedState(sw::runtime::HostStore(), {other->a->weight}));
                   }),
                   "stagewise::runtime::OffloadedState: a tensor of shape [16, 6] it was given "
                   "to hold is not one of the optimizer's parameters"));
    CHECK(contains(error_of([&] {
                     sw::optim::FusedStep f(net->parameters(), optim::AdamOptions(1e-3));
                     f.offload_state(sw::runtime::OffloadedState(sw::runtime::HostStore(), 1.5));
                   }),
                   "the share is 1.5; give a share of the parameters' bytes from 0 (none) to 1"));
  }

  TEST_CASE("step_parameter (a data-parallel step, hooks detached) applies each update at once") {
    // As distributed::DataParallel::step_with steps each parameter once its average is written.
    const auto want = values(test::train_unfused(optim::AdamOptions(1e-2), {}, 3));
    auto net = test::make_net({});
    sw::optim::FusedStep fused(net->named_parameters(), optim::AdamOptions(1e-2));
    fused.offload_state(sw::runtime::OffloadedState(sw::runtime::HostStore(), 0.5));
    fused.detach();
    for (int s = 0; s < 3; ++s) {
      test::forward_backward(net, s);
      for (std::size_t i = 0; i < fused.size(); ++i) {
        const auto before = net->parameters()[i].detach().clone();
        fused.step_parameter(i);
        CHECK_FALSE(torch::equal(net->parameters()[i], before));  // updated on return
      }
    }
    CHECK(equal(values(net), want));
  }

  TEST_CASE("saves load into an optimizer with or without offloaded state, bit for bit") {
    // Train 3 steps, save, load into the other kind, train 3 more: every way round equals 6
    // steps of the plain optimizer.
    const auto want = values(test::train_unfused(optim::AdamOptions(1e-2), {}, 6));
    TempDir dir("state_saves");
    const auto file = (dir.path / "adam.pt").string();
    enum Kind { kPlain, kFused, kFusedOffloaded, kOffloaded };
    // One optimizer of a kind: fused (with or without offloaded state) or not.
    struct Opt {
      std::unique_ptr<sw::optim::FusedStep> fused;
      std::unique_ptr<optim::Optimizer> unfused;
      void step() {
        if (fused) {
          fused->finish_step();
        } else {
          unfused->step();
          unfused->zero_grad();
        }
      }
      void save(const std::string& f) {
        torch::serialize::OutputArchive a;
        if (fused)
          fused->save(a);
        else
          unfused->save(a);
        a.save_to(f);
      }
      void load(const std::string& f) {
        torch::serialize::InputArchive a;
        a.load_from(f);
        if (fused)
          fused->load(a);
        else
          unfused->load(a);
      }
    };
    auto make = [&](Net& net, Kind k) {
      Opt o;
      if (k == kPlain)
        o.unfused = std::make_unique<optim::Adam>(net->parameters(), optim::AdamOptions(1e-2));
      if (k == kOffloaded) {
        o.unfused = std::make_unique<sw::optim::OffloadedOptimizer>(
            net->named_parameters(), optim::AdamOptions(1e-2),
            sw::runtime::OffloadedState(sw::runtime::HostStore()));
      }
      if (k == kFused || k == kFusedOffloaded) {
        o.fused = std::make_unique<sw::optim::FusedStep>(net->named_parameters(),
                                                         optim::AdamOptions(1e-2));
      }
      if (k == kFusedOffloaded) {
        o.fused->offload_state(
            sw::runtime::OffloadedState(sw::runtime::FileStore(dir.path.string()), 0.5));
      }
      return o;
    };
    auto train = [](Net& net, Opt& o, int from) {
      for (int s = from; s < from + 3; ++s) {
        test::forward_backward(net, s);
        o.step();
      }
    };
    for (Kind from : {kPlain, kFused, kFusedOffloaded, kOffloaded}) {
      for (Kind to : {kPlain, kFused, kFusedOffloaded, kOffloaded}) {
        if (from != kFusedOffloaded && from != kOffloaded && to != kFusedOffloaded &&
            to != kOffloaded)
          continue;
        CAPTURE(from);
        CAPTURE(to);
        auto net = test::make_net({});
        {
          auto o = make(net, from);
          train(net, o, 0);
          o.save(file);
        }
        auto o = make(net, to);
        o.load(file);
        train(net, o, 3);
        CHECK(equal(values(net), want));
      }
    }
  }
}
