// Uses stagewise from an ordinary CMake project: micro-batches and a fork/join ordering edge.
#include <stagewise/stagewise.hpp>

#include <iostream>

int main() {
  namespace sw = stagewise;
  auto x = torch::arange(6, torch::kFloat).view({3, 2}).requires_grad_();
  auto micro = sw::scatter(sw::Batch(x), 2);
  auto [first, phony] = sw::fork(micro[0].tensor() * 2);
  auto second = sw::join(micro[1].tensor() * 3, phony);
  auto y = sw::gather({sw::Batch(first), sw::Batch(second)}).tensor();
  y.sum().backward();
  const bool ok = micro.size() == 2 && x.grad().equal(torch::tensor({{2.f, 2.f}, {2.f, 2.f}, {3.f, 3.f}}));
  std::cout << "consumer " << (ok ? "ok" : "WRONG") << ": grad " << x.grad().view(-1) << "\n";
  return ok ? 0 : 1;
}
