#pragma once

// Test helper: what a peer that speaks Gloo but not (quite) stagewise sends: the transfers an
// honest rank would send, cut short or altered, crafted first transfers, random words; sent under
// the tags of the messages a rank of the pipe waits for. And `connected()`, a rank's connection
// once every rank has one.

#include "stagewise/runtime/c10d/detail/header.hpp"
#include "stagewise/runtime/c10d/env.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/keys.hpp"
#include "stagewise/runtime/message.hpp"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/types.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

namespace stagewise::testing {

// Inside a rank of run_ranks: joins the job, and returns once every rank has connected and is
// past the Gloo set-up.
inline runtime::Connection connected() {
  auto c = runtime::connect(runtime::rendezvous_env(),
                            runtime::ConnectOptions{std::chrono::seconds(10)});
  c.store->add("ready", 1);
  while (c.store->add("ready", 0) < c.env.world_size) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return c;
}

// The transfers an honest rank sends for `m` over Gloo (`room` 0: every tensor on its own).
inline std::vector<torch::Tensor> honest(const runtime::Message& m,
                                         std::int64_t room = runtime::detail::kInlineBytes) {
  return runtime::detail::transfers_of(m, torch::kCPU, room);
}

// A first transfer of 512 bytes as stagewise lays one out: `words`, zeros, the end mark.
inline torch::Tensor first_transfer(const std::vector<std::int64_t>& words) {
  auto t = torch::zeros({runtime::detail::kHeaderWords}, torch::kInt64);
  std::copy(words.begin(), words.end(), t.data_ptr<std::int64_t>());
  t[runtime::detail::kHeaderWords - 1] = runtime::detail::end_mark(runtime::detail::kBlockBytes);
  return t;
}

// The first `words` words of a transfer: what a peer that stops early sends.
inline torch::Tensor cut(const torch::Tensor& t, std::int64_t words) {
  return t.narrow(0, 0, words).clone();
}

// 64 words no program wrote on purpose (seeded: the same on every run).
inline torch::Tensor random_words() {
  auto g = torch::make_generator<at::CPUGeneratorImpl>(37);
  return torch::randint(std::numeric_limits<std::int64_t>::min(),
                        std::numeric_limits<std::int64_t>::max(), {64}, g,
                        torch::TensorOptions().dtype(torch::kInt64));
}

// A rogue's sends: started in order, their work kept (with their tensors) until it exits, never
// waited for (a refused transfer's receive is never posted).
struct Sends {
  runtime::Connection& c;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  void operator()(const torch::Tensor& t, int to, const runtime::MessageKey& k) {
    std::vector<at::Tensor> one{t};
    works.push_back(c.group.send(one, to, runtime::detail::message_tag(k, 0)));
  }
};

}  // namespace stagewise::testing
