// amp::GradScaler with the unfused optimizer: the scale over 300 steps with overflows injected at
// chosen steps follows PyTorch's documented rules (and, where Python's torch >= 2.3 is at hand,
// equals torch.amp.GradScaler("cpu") on the same gradients); skipped steps change nothing; bad
// use is named as PyTorch names it; a disabled scaler is a no-op; its state saves and loads.
#include <stagewise/stagewise.hpp>

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace sw = stagewise;
using sw::testing::error_of;

namespace {

// PyTorch's rules, from torch.amp.GradScaler's documentation, on a float32 scale: a step whose
// gradients hold an inf or a NaN is skipped and the scale multiplied by backoff_factor; after
// growth_interval unskipped steps in a row it is multiplied by growth_factor.
struct Rules {
  float scale;
  double growth, backoff;
  int interval;
  int clean = 0;
  void after(bool found_inf) {
    if (found_inf) {
      scale = static_cast<float>(scale * backoff);
      clean = 0;
    } else if (++clean == interval) {
      scale = static_cast<float>(scale * growth);
      clean = 0;
    }
  }
};

const float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();

// `steps` steps of a Linear(3, 2) with SGD under `scaler`; at the steps in `bad` one bias
// gradient is made inf (even steps) or NaN (odd). Checks each step's outcome and the scale
// against the rules, and the parameters against SGD on the unscaled loss that skips the bad
// steps (the scale is a power of two, so scaling and unscaling are exact).
void check_sequence(sw::amp::GradScaler& scaler, Rules rules, int steps, const std::set<int>& bad) {
  torch::manual_seed(11);
  torch::nn::Linear model(3, 2), plain(3, 2);
  {
    torch::NoGradGuard no_grad;
    plain->weight.copy_(model->weight);
    plain->bias.copy_(model->bias);
  }
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD plain_opt(plain->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int s = 0; s < steps; ++s) {
    CAPTURE(s);
    const auto x = torch::randn({4, 3});
    opt.zero_grad();
    scaler.scale(model->forward(x).pow(2).mean()).backward();
    const bool injected = bad.count(s) > 0;
    if (injected) model->bias.mutable_grad()[1].fill_(s % 2 == 0 ? kInf : kNaN);
    const auto before = model->weight.detach().clone();
    const bool stepped = scaler.step(opt);
    CHECK(stepped == !injected);
    if (injected) CHECK(torch::equal(before, model->weight));
    if (!injected) {
      plain_opt.zero_grad();
      plain->forward(x).pow(2).mean().backward();
      plain_opt.step();
    }
    scaler.update();
    rules.after(injected);
    REQUIRE(scaler.get_scale() == static_cast<double>(rules.scale));
    CHECK(scaler.growth_tracker() == rules.clean);
  }
  CHECK(torch::equal(model->weight, plain->weight));
  CHECK(torch::equal(model->bias, plain->bias));
}

// Runs `script` with Python's torch >= 2.3 and returns its output, or "" (with the reason in
// `why`) where there is none: Debian 12's python3-torch is 1.13, without a CPU GradScaler. The
// version is read from torch/version.py (importing torch takes seconds).
std::string run_python(const std::string& script, std::string& why) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = tmp ? tmp : "/tmp";
  const std::string python = ::access("/usr/bin/python3", X_OK) == 0 ? "/usr/bin/python3" : "python3";
  std::ofstream(dir + "/torch_version.py")
      << "import importlib.util, os, re\n"
         "s = importlib.util.find_spec('torch')\n"
         "v = open(os.path.join(s.submodule_search_locations[0], 'version.py')).read()\n"
         "print(re.search(r\"__version__[^=]*=\\s*'([^']+)'\", v).group(1))\n";
  char buf[256] = {0};
  FILE* v = ::popen((python + " " + dir + "/torch_version.py 2>/dev/null").c_str(), "r");
  const bool read = v != nullptr && std::fgets(buf, sizeof buf, v) != nullptr;
  if (v != nullptr) ::pclose(v);
  int major = 0, minor = 0;
  if (!read || std::sscanf(buf, "%d.%d", &major, &minor) != 2) {
    why = "no Python torch found (" + python + ")";
    return "";
  }
  if (major < 2 || (major == 2 && minor < 3)) {
    why = "Python's torch is " + std::to_string(major) + "." + std::to_string(minor) +
          "; torch.amp.GradScaler(\"cpu\") needs 2.3";
    return "";
  }
  std::ofstream(dir + "/grad_scaler_reference.py") << script;
  FILE* p = ::popen(
      (python + " " + dir + "/grad_scaler_reference.py 2>" + dir + "/grad_scaler_reference.err")
          .c_str(),
      "r");
  std::string out;
  while (p != nullptr && std::fgets(buf, sizeof buf, p) != nullptr) out += buf;
  if (p != nullptr) ::pclose(p);
  if (out.empty()) {  // torch >= 2.3 is there, so this is a failure: say what Python said
    std::ifstream err(dir + "/grad_scaler_reference.err");
    out = "python failed: " + std::string(std::istreambuf_iterator<char>(err), {});
  }
  return out;
}

// The same gradients for Python and C++: step s scales g = (s % 5 + 1) / 4 * [1, 2, 3, 4] and
// makes element 1 inf (even s) or NaN (odd s) at the bad steps; SGD(lr 0.1) on zeros(4).
const char* kPythonReference = R"(
import torch
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
p = torch.zeros(4, requires_grad=True)
opt = torch.optim.SGD([p], lr=0.1)
bad = {2, 3, 9, 20, 21, 22, 40}
for s in range(60):
    g = torch.tensor([1.0, 2.0, 3.0, 4.0]) * ((s % 5 + 1) / 4)
    p.grad = scaler.scale(g)
    if s in bad:
        p.grad[1] = float("inf") if s % 2 == 0 else float("nan")
    scaler.step(opt)
    scaler.update()
    print(" ".join(float(v).hex() for v in [scaler.get_scale()] + p.tolist()))
)";

}  // namespace

TEST_SUITE("amp::GradScaler") {
  TEST_CASE("300 steps with overflows injected: PyTorch's rules, skips change nothing") {
    const std::set<int> bad = {0, 1, 2, 17, 40, 41, 99, 150, 151, 152, 230, 298, 299};
    sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().growth_interval(10));
    check_sequence(scaler, Rules{65536.f, 2.0, 0.5, 10}, 300, bad);
    CHECK(scaler.get_scale() > 65536.0);  // it grew in between
  }

  TEST_CASE("other factors: the float scale rounds as the rules on a float32 scale say") {
    sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().init_scale(1000).growth_factor(3).backoff_factor(0.3).growth_interval(3));
    torch::manual_seed(2);
    torch::nn::Linear model(3, 2);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
    Rules rules{1000.f, 3.0, 0.3, 3};
    for (int s = 0; s < 40; ++s) {
      opt.zero_grad();
      scaler.scale(model->forward(torch::randn({2, 3})).sum() * 1e-3).backward();
      const bool injected = s % 7 == 5;
      if (injected) model->weight.mutable_grad()[0][0].fill_(kInf);
      CHECK(scaler.step(opt) == !injected);
      scaler.update();
      rules.after(injected);
      CHECK(scaler.get_scale() == static_cast<double>(rules.scale));
    }
  }

  TEST_CASE("the scale never grows past float's range") {
    sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().init_scale(std::ldexp(1.0, 127)).growth_interval(1));
    torch::nn::Linear model(2, 1);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    scaler.scale((model->forward(torch::ones({1, 2})) * 0).sum()).backward();  // zero gradients
    CHECK(scaler.step(opt));
    scaler.update();
    CHECK(scaler.get_scale() == std::ldexp(1.0, 127));
    CHECK(scaler.growth_tracker() == 0);
  }

  TEST_CASE("update(new_scale) sets the scale; unscale_ then step steps once on unscaled grads") {
    sw::amp::GradScaler scaler;
    torch::nn::Linear model(2, 1);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    auto loss = model->forward(torch::ones({1, 2})).sum();
    scaler.scale(loss).backward();
    scaler.unscale_(opt);
    CHECK(torch::equal(model->bias.grad(), torch::ones({1})));  // d(sum)/d(bias) = 1, unscaled
    CHECK(scaler.step(opt));
    scaler.update(128.0);
    CHECK(scaler.get_scale() == 128.0);
    CHECK(scaler.scale(torch::ones({})).item<float>() == 128.f);
  }

  TEST_CASE("bad use is named as PyTorch names it") {
    torch::nn::Linear model(2, 1);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    sw::amp::GradScaler scaler;
    CHECK(error_of([&] { scaler.step(opt); }) ==
          "stagewise::amp::GradScaler::step: attempted step but the scale is not set. This may "
          "indicate your program did not use scaler.scale(loss) (or a pipe's train_step with the "
          "scaler) earlier in the step");
    CHECK(error_of([&] { scaler.update(); }).find("attempted update but the scale is not set") !=
          std::string::npos);
    scaler.scale(model->forward(torch::ones({1, 2})).sum()).backward();
    scaler.unscale_(opt);
    CHECK(error_of([&] { scaler.unscale_(opt); }) ==
          "stagewise::amp::GradScaler::unscale_: unscale_() has already been called on this "
          "optimizer since the last update(). Call it once per step, before step()");
    scaler.step(opt);
    CHECK(error_of([&] { scaler.unscale_(opt); }) ==
          "stagewise::amp::GradScaler::unscale_: unscale_() is being called after step(). Call "
          "it before step(), or call update() first to begin the next step");
    CHECK(error_of([&] { scaler.step(opt); }) ==
          "stagewise::amp::GradScaler::step: step() has already been called since the last "
          "update(). Call update() once per step, after every optimizer's step()");
    scaler.update();
    CHECK(error_of([&] { scaler.update(); }) ==
          "stagewise::amp::GradScaler::update: no inf checks were recorded prior to update(). "
          "Call step(optimizer) (or unscale_) first in every step");
    torch::optim::SGD unused(std::vector<torch::Tensor>{torch::zeros({1}, torch::requires_grad())},
                             torch::optim::SGDOptions(0.1));
    CHECK(error_of([&] { scaler.step(unused); }).find("no inf checks were recorded for this optimizer") !=
          std::string::npos);
    CHECK(error_of([&] { sw::amp::GradScaler(sw::amp::GradScalerOptions().growth_factor(1.0)); }) ==
          "stagewise::amp::GradScaler: growth_factor is 1; the growth factor must be > 1.0");
    CHECK(error_of([&] { sw::amp::GradScaler(sw::amp::GradScalerOptions().backoff_factor(1.0)); }) ==
          "stagewise::amp::GradScaler: backoff_factor is 1; the backoff factor must be < 1.0");
  }

  TEST_CASE("fp16 gradients are refused: keep fp32 parameters and autocast the forward") {
    auto p = torch::ones({2}, torch::TensorOptions(torch::kHalf).requires_grad(true));
    torch::optim::SGD opt(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(0.1));
    sw::amp::GradScaler scaler;
    scaler.scale(torch::ones({}));
    p.mutable_grad() = torch::ones({2}, torch::kHalf);
    CHECK(error_of([&] { scaler.unscale_(opt); }).find("attempting to unscale FP16 gradients") !=
          std::string::npos);
  }

  TEST_CASE("a disabled scaler's calls are no-ops, as PyTorch's: step just steps") {
    sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().enabled(false));
    torch::nn::Linear model(2, 1);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    const auto loss = model->forward(torch::ones({1, 2})).sum();
    CHECK(scaler.scale(loss).is_same(loss));
    loss.backward();
    model->bias.mutable_grad().fill_(kInf);
    scaler.unscale_(opt);
    CHECK(std::isinf(model->bias.grad().item<float>()));  // not unscaled, not checked
    CHECK(scaler.step(opt));                               // stepped, inf and all
    CHECK(std::isinf(model->bias.item<float>()));
    scaler.update();
    scaler.update(5.0);
    CHECK(scaler.get_scale() == 1.0);
    CHECK_FALSE(scaler.is_enabled());
    std::ostringstream saved;
    torch::save(scaler, saved);  // nothing to save, as PyTorch's empty state_dict
    sw::amp::GradScaler enabled;
    std::istringstream in(saved.str());
    CHECK(error_of([&] { torch::load(enabled, in); }) ==
          "stagewise::amp::GradScaler::load: the saved state is empty, possibly because it was "
          "saved from a disabled GradScaler");
  }

  TEST_CASE("save and load: a new scaler continues the sequence exactly") {
    const std::set<int> bad = {1, 6, 7, 15};
    sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().growth_interval(3));
    Rules rules{65536.f, 2.0, 0.5, 3};
    check_sequence(scaler, rules, 12, bad);  // ends part-way through a growth interval
    for (int s = 0; s < 12; ++s) rules.after(bad.count(s) > 0);
    std::stringstream saved;
    torch::save(scaler, saved);
    sw::amp::GradScaler resumed(sw::amp::GradScalerOptions().growth_interval(50).init_scale(3));
    torch::load(resumed, saved);
    CHECK(resumed.get_scale() == scaler.get_scale());
    CHECK(resumed.growth_tracker() == scaler.growth_tracker());
    CHECK(resumed.get_growth_interval() == 3);
    check_sequence(resumed, rules, 6, {4});  // the resumed scaler goes on by the same rules
  }

  TEST_CASE("the plain kernels equal LibTorch's where this LibTorch has them on the CPU") {
    const bool kernels = sw::detail::amp_kernels_on(torch::kCPU);
#if STAGEWISE_AMP_CPU_KERNELS
    REQUIRE(kernels);
    for (auto dtype : {torch::kFloat, torch::kBFloat16, torch::kDouble}) {
      CAPTURE(dtype);
      torch::manual_seed(4);
      auto g = (torch::randn({1000}) * 1e4).to(dtype);
      for (const bool bad : {false, true}) {
        auto a = g.clone(), b = g.clone();
        if (bad) a[7] = b[7] = kInf;
        auto fa = torch::zeros({}), fb = torch::zeros({});
        const auto inv = torch::full({}, 1.0 / 3072.0, torch::kFloat);
        sw::detail::unscale_and_check(a, fa, inv);
        sw::detail::plain_unscale(b, fb, inv);
        CHECK(torch::equal(a, b));
        CHECK(fa.item<float>() == fb.item<float>());
        CHECK(fa.item<float>() == (bad ? 1.f : 0.f));
      }
    }
#else
    CHECK_FALSE(kernels);  // LibTorch < 2.3: the plain ones run (the CPU has no kernel)
    MESSAGE("LibTorch < 2.3: no CPU GradScaler kernels to compare the plain ones with");
#endif
  }

  TEST_CASE("Python's torch.amp.GradScaler(\"cpu\") on the same gradients (torch >= 2.3)") {
    std::string why;
    const std::string python = run_python(kPythonReference, why);
    if (python.empty()) {
      MESSAGE("not compared with Python: " << why);
      return;
    }
    sw::amp::GradScaler scaler(sw::amp::GradScalerOptions().init_scale(1024).growth_interval(4));
    auto p = torch::zeros({4}, torch::requires_grad());
    torch::optim::SGD opt(std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(0.1));
    const std::set<int> bad = {2, 3, 9, 20, 21, 22, 40};
    INFO("Python's output: " << python);
    std::istringstream lines(python);
    for (int s = 0; s < 60; ++s) {
      CAPTURE(s);
      auto g = torch::tensor({1.f, 2.f, 3.f, 4.f}) * ((s % 5 + 1) / 4.0);
      p.mutable_grad() = scaler.scale(g);
      if (bad.count(s)) p.mutable_grad()[1].fill_(s % 2 == 0 ? kInf : kNaN);
      scaler.step(opt);
      scaler.update();
      std::string line;
      REQUIRE(std::getline(lines, line));
      std::istringstream fields(line);
      std::string f;
      std::vector<double> theirs;
      while (fields >> f) theirs.push_back(std::strtod(f.c_str(), nullptr));
      REQUIRE(theirs.size() == 5);
      CHECK(theirs[0] == scaler.get_scale());
      for (int k = 0; k < 4; ++k) CHECK(theirs[1 + k] == p[k].item<double>());
    }
  }
}
