// A deliberately racy program: proves that ThreadSanitizer, with the project's suppressions
// (tests/sanitizers/sanitizer_defaults.cpp), still reports a race in our own frames when
// LibTorch's autograd engine is on the stack. tsan_canary_test.sh runs it and fails unless both
// races below are reported. Built with -fsanitize=thread whatever the configuration (see BUILD);
// without ThreadSanitizer it runs nothing racy and says so.
//
// Race 1: two threads each run backward through a custom autograd Function whose backward (run
// by the engine) increments a plain int. Race 2: the same from a post hook on a leaf's
// AccumulateGrad node, where optim::FusedStep steps a parameter.
#include <torch/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/types.h>

#include <atomic>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

namespace {

int racy_backward_count = 0;  // written by both threads with no synchronization: the race
int racy_hook_count = 0;      // likewise, from the AccumulateGrad post hooks

// Holds each thread right after its write until the other has written too, without any
// synchronization TSan could see (relaxed atomics order nothing), so that no lock LibTorch
// happens to take in between orders the two writes and hides the race.
void wait_for_both(std::atomic<int>& arrived) {
  arrived.fetch_add(1, std::memory_order_relaxed);
  while (arrived.load(std::memory_order_relaxed) < 2) std::this_thread::yield();
}

std::atomic<int> backward_arrivals{0};
std::atomic<int> hook_arrivals{0};

__attribute__((noinline)) void canary_backward_write() {
  racy_backward_count = racy_backward_count + 1;
  wait_for_both(backward_arrivals);
}

__attribute__((noinline)) void canary_hook_write() {
  racy_hook_count = racy_hook_count + 1;
  wait_for_both(hook_arrivals);
}

// Identity whose backward, run by the autograd engine, writes the racy int.
struct CanaryFunction : torch::autograd::Function<CanaryFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    canary_backward_write();
    return grads;
  }
};

// A post hook on AccumulateGrad, where optim::FusedStep steps its parameter.
struct CanaryHook final : torch::autograd::FunctionPostHook {
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    canary_hook_write();
    return outputs;
  }
};

// One thread's work: its own leaf and graph, backward run by the engine on this thread.
void run_backward_through_engine() {
  auto leaf = torch::ones({4}, torch::requires_grad());
  auto accumulator = torch::autograd::impl::grad_accumulator(leaf);
  accumulator->add_post_hook(std::make_unique<CanaryHook>());
  CanaryFunction::apply(leaf * 2).sum().backward();
}

}  // namespace

int main() {
#if defined(__SANITIZE_THREAD__)
  std::vector<std::thread> threads;
  for (int i = 0; i < 2; ++i) threads.emplace_back(run_backward_through_engine);
  for (auto& t : threads) t.join();
  std::printf("tsan_canary: ran both racy backward passes (count %d, hooks %d)\n",
              racy_backward_count, racy_hook_count);
  return 0;
#else
  std::printf("tsan_canary: not built with ThreadSanitizer; nothing racy was run\n");
  return 3;
#endif
}
