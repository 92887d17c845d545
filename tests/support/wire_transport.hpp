#pragma once

// A transport of the tests' own, in one header over the public `runtime::pipe_transport` concept:
// what adding a transport takes. Two "ranks" run in one process, each a `stagewise::PipeOver`
// keeping one stage of a two-stage model, joined by a wire that hands messages to the other
// rank's mailbox. `using WirePipe = stagewise::PipeOver<WireEnd>;` is the whole pipe.

#include "stagewise/pipe/pipe_over.hpp"
#include "stagewise/runtime/mailbox_transport.hpp"
#include "stagewise/runtime/processes.hpp"
#include "stagewise/runtime/transport.hpp"

#include <torch/types.h>

#include <array>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::testing {

namespace sw = stagewise;
using sw::runtime::Message;
using sw::runtime::MessageKey;

// What joins the two ranks: a mailbox each (stage j's messages go to rank j's), a barrier at the
// start of each step (so no message reaches a mailbox before its rank began the step), and the
// shared step values.
struct Wire {
  std::array<sw::runtime::MailboxTransport, 2> inbox;
  std::mutex mutex;
  std::condition_variable changed;
  std::array<std::int64_t, 2> begun{0, 0};
  std::array<std::int64_t, 2> ended{0, 0};
  std::map<std::pair<std::int64_t, int>, torch::Tensor> values;  // (step, index) -> value
  std::map<std::int64_t, std::array<std::optional<std::string>, 2>> gathered;  // by call
  int failed = -1;  // the first rank that aborted
  std::string what;
};

// One rank's end of the wire: the transport class a new transport would be.
class WireEnd {
 public:
  WireEnd(std::shared_ptr<Wire> wire, int rank) : wire_(std::move(wire)), rank_(rank) {}

  void send(const MessageKey& k, Message m) {
    if (k.stage != rank_) ++traffic_.messages_sent;
    wire_->inbox[static_cast<std::size_t>(k.stage)].send(k, std::move(m));
  }
  // As a transport between processes must: nothing once this rank aborted, an error naming the
  // rank once another one did.
  std::optional<Message> recv(const MessageKey& k) {
    auto m = wire_->inbox[static_cast<std::size_t>(rank_)].recv(k);
    if (!m) throw_if_other_failed();
    if (m && k.stage != source(k)) ++traffic_.messages_received;
    return m;
  }
  // The mailboxes first, then the word: a rank that sees `failed` set finds its mailbox's first
  // error already there (the one the pipe rethrows), as C10dTransport::abort orders it.
  void abort(std::exception_ptr e) {
    for (auto& box : wire_->inbox) box.abort(e);
    std::lock_guard<std::mutex> lock(wire_->mutex);
    if (wire_->failed < 0) {
      wire_->failed = rank_;
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        wire_->what = x.what();
      } catch (...) {
      }
    }
    wire_->changed.notify_all();
  }
  void begin_step(const sw::schedule::Plan& plan,
                  const std::vector<sw::schedule::SkipRoute>& routes) {
    ++begun_;
    wire_->inbox[static_cast<std::size_t>(rank_)].begin_step(plan, routes);
    std::unique_lock<std::mutex> lock(wire_->mutex);
    wire_->begun[static_cast<std::size_t>(rank_)] = step_;
    wire_->changed.notify_all();
    wire_->changed.wait(lock, [&] { return wire_->begun[0] >= step_ && wire_->begun[1] >= step_; });
  }
  torch::Tensor share(const torch::Tensor& value, int from, int index) {
    shares_.push_back({from, index});
    if (index == 0) ++step_;  // the count opens every step
    std::unique_lock<std::mutex> lock(wire_->mutex);
    const auto key = std::make_pair(step_, index);
    if (from == rank_) {
      wire_->values[key] = value.detach();
      wire_->changed.notify_all();
      return value;
    }
    wire_->changed.wait(lock, [&] { return wire_->failed >= 0 || wire_->values.count(key) > 0; });
    if (wire_->values.count(key) > 0) return wire_->values[key];
    lock.unlock();
    throw_if_other_failed();
    return {};
  }
  // Returns once both ranks finished the step; throws when the other one failed instead.
  void end_step() {
    {
      std::unique_lock<std::mutex> lock(wire_->mutex);
      wire_->ended[static_cast<std::size_t>(rank_)] = step_;
      wire_->changed.notify_all();
      wire_->changed.wait(lock, [&] {
        return wire_->failed >= 0 || (wire_->ended[0] >= step_ && wire_->ended[1] >= step_);
      });
      if (wire_->failed < 0) return;
    }
    throw_if_other_failed();
  }
  std::exception_ptr error() const { return wire_->inbox[static_cast<std::size_t>(rank_)].error(); }
  sw::runtime::Traffic traffic() const { return traffic_; }
  // Stage j runs on rank j.
  sw::runtime::Processes processes() const { return {rank_, 2, {0, 1}}; }
  // Both ranks' texts, once both gave theirs; throws once the other rank failed.
  std::vector<std::string> gather(const std::string& /*what*/, const std::string& mine) {
    const auto call = ++gathers_;
    {
      std::unique_lock<std::mutex> lock(wire_->mutex);
      auto& slots = wire_->gathered[call];
      slots[static_cast<std::size_t>(rank_)] = mine;
      wire_->changed.notify_all();
      wire_->changed.wait(lock, [&] {
        return wire_->failed >= 0 || (slots[0].has_value() && slots[1].has_value());
      });
      if (slots[0].has_value() && slots[1].has_value()) return {*slots[0], *slots[1]};
    }
    throw_if_other_failed();
    throw std::runtime_error("rank " + std::to_string(rank_) + " aborted before the gather");
  }

  int begun() const { return begun_; }
  const std::vector<std::pair<int, int>>& shares() const { return shares_; }

 private:
  void throw_if_other_failed() {
    std::lock_guard<std::mutex> lock(wire_->mutex);
    if (wire_->failed >= 0 && wire_->failed != rank_) {
      throw std::runtime_error("rank " + std::to_string(wire_->failed) + " failed: " + wire_->what);
    }
  }
  static int source(const MessageKey& k) {
    return k.kind == sw::schedule::TransferKind::activation ? k.stage - 1 : k.stage + 1;
  }

  std::shared_ptr<Wire> wire_;
  int rank_;
  std::int64_t step_ = 0;
  std::int64_t gathers_ = 0;
  int begun_ = 0;
  std::vector<std::pair<int, int>> shares_;
  sw::runtime::Traffic traffic_;
};

static_assert(sw::runtime::pipe_transport<WireEnd>);

/// The pipe over the wire: rank r keeps stage r.
using WirePipe = sw::PipeOver<WireEnd>;

}  // namespace stagewise::testing
