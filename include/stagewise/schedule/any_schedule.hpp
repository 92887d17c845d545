#pragma once

#include "stagewise/coro/generator.hpp"
#include "stagewise/schedule/action.hpp"
#include "stagewise/schedule/concepts.hpp"

#include <memory>
#include <string>
#include <utility>

namespace stagewise::schedule {

/// Any pipeline schedule behind one type, with its name: what `choose` returns, and what a
/// program keeps when it picks the schedule at run time. It runs, verifies, simulates and
/// draws like the schedule it holds, and places stages as that schedule does (k % workers for
/// one that does not say).
///   stagewise::schedule::any_schedule s(stagewise::schedule::v_min{});  // its own name
///   pipe->train_step(x, y, loss_fn, s);
///   s.name();  // "v_min"
class any_schedule {
 public:
  /// Holds `s` under the name given.
  template <pipeline_schedule S>
  any_schedule(std::string name, S s)
      : name_(std::move(name)), held_(std::make_shared<const Held<S>>(std::move(s))) {}
  /// Holds `s` under its own name (`name_of(s)`: "v_min", "interleaved_one_f_one_b{2}").
  template <named_schedule S>
  explicit any_schedule(const S& s) : any_schedule(name_of(s), s) {}

  /// The name it was given.
  const std::string& name() const { return name_; }
  /// Workers for `stages` stages, as the held schedule says (one per stage if it does not).
  int workers(int stages) const { return held_->workers(stages); }
  /// The worker of `stage`, as the held schedule says (k % workers if it does not).
  int worker_of(int stage, int stages) const { return held_->worker_of(stage, stages); }
  coro::generator<Action> operator()(int stages, int micro_batches) const {
    return run(held_, stages, micro_batches);
  }
  /// Copies of one any_schedule are equal (they hold the same schedule); two made apart are not,
  /// whatever they hold.
  friend bool operator==(const any_schedule& a, const any_schedule& b) {
    return a.held_ == b.held_ && a.name_ == b.name_;
  }

 private:
  struct Base {
    virtual ~Base() = default;
    virtual int workers(int stages) const = 0;
    virtual int worker_of(int stage, int stages) const = 0;
    virtual coro::generator<Action> run(int stages, int micro_batches) const = 0;
  };
  template <class S>
  struct Held final : Base {
    explicit Held(S s) : s(std::move(s)) {}
    int workers(int stages) const override { return workers_of(s, stages); }
    int worker_of(int stage, int stages) const override {
      if constexpr (placed_schedule<S>) {
        return static_cast<int>(s.worker_of(stage, stages));
      } else {
        return stage % workers_of(s, stages);
      }
    }
    coro::generator<Action> run(int stages, int micro_batches) const override {
      return s(stages, micro_batches);
    }
    S s;
  };
  // The coroutine's frame keeps the held schedule alive, however long the caller keeps the
  // generator.
  static coro::generator<Action> run(std::shared_ptr<const Base> held, int stages,
                                     int micro_batches) {
    for (const auto& a : held->run(stages, micro_batches)) co_yield a;
  }
  std::string name_;
  std::shared_ptr<const Base> held_;
};

static_assert(placed_schedule<any_schedule>);

}  // namespace stagewise::schedule
