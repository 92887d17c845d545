#pragma once

#include <coroutine>
#include <exception>
#include <iterator>
#include <memory>
#include <type_traits>
#include <utility>

namespace stagewise::coro {

template <class T>
class generator;

namespace detail {

template <class>
inline constexpr bool always_false = false;

template <class T>
class generator_promise {
 public:
  using value_type = std::remove_cvref_t<T>;

  generator<T> get_return_object() noexcept;

  std::suspend_always initial_suspend() const noexcept { return {}; }  // lazy start
  std::suspend_always final_suspend() const noexcept { return {}; }

  // The yielded object outlives the suspension: a temporary in `co_yield expr` lives until the
  // coroutine resumes, so storing its address is enough.
  std::suspend_always yield_value(const value_type& value) noexcept {
    value_ = std::addressof(value);
    return {};
  }
  std::suspend_always yield_value(value_type&& value) noexcept {
    value_ = std::addressof(value);
    return {};
  }

  void return_void() noexcept {}
  void unhandled_exception() noexcept { exception_ = std::current_exception(); }

  template <class U>
  std::suspend_never await_transform(U&&) {
    static_assert(always_false<U>,
                  "stagewise::coro::generator: co_await is not allowed inside a generator; a "
                  "generator only yields values. Use co_yield, or write a task if you need to wait.");
    return {};
  }

  const value_type& value() const noexcept { return *value_; }

  void rethrow_if_failed() const {
    if (exception_) std::rethrow_exception(exception_);
  }

 private:
  const value_type* value_ = nullptr;
  std::exception_ptr exception_;
};

}  // namespace detail

/// A lazy, move-only, synchronous coroutine generator (g++ 12 has no std::generator).
///
/// The body runs only as the consumer iterates; `co_await` is rejected at compile time; an
/// exception thrown in the body reaches the consumer at the `++`/`begin()` that resumed it.
///   stagewise::coro::generator<int> count(int n) { for (int i = 0; i < n; ++i) co_yield i; }
///   for (int i : count(3)) ...;  // 0, 1, 2
template <class T>
class [[nodiscard]] generator {
 public:
  using promise_type = detail::generator_promise<T>;
  using value_type = typename promise_type::value_type;
  using handle_type = std::coroutine_handle<promise_type>;

  /// Input iterator over the yielded values; `*it` is valid until the next increment.
  class iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using difference_type = std::ptrdiff_t;
    using value_type = generator::value_type;
    using reference = const value_type&;
    using pointer = const value_type*;

    iterator() noexcept = default;
    explicit iterator(handle_type handle) noexcept : handle_(handle) {}

    friend bool operator==(const iterator& it, std::default_sentinel_t) noexcept {
      return !it.handle_ || it.handle_.done();
    }

    iterator& operator++() {
      handle_.resume();
      if (handle_.done()) handle_.promise().rethrow_if_failed();
      return *this;
    }
    void operator++(int) { ++*this; }

    reference operator*() const noexcept { return handle_.promise().value(); }
    pointer operator->() const noexcept { return std::addressof(**this); }

   private:
    handle_type handle_;
  };

  generator() noexcept = default;
  explicit generator(handle_type handle) noexcept : handle_(handle) {}
  generator(generator&& other) noexcept : handle_(std::exchange(other.handle_, {})) {}
  generator& operator=(generator&& other) noexcept {
    if (this != &other) {
      if (handle_) handle_.destroy();
      handle_ = std::exchange(other.handle_, {});
    }
    return *this;
  }
  generator(const generator&) = delete;
  generator& operator=(const generator&) = delete;
  ~generator() {
    if (handle_) handle_.destroy();
  }

  /// Starts the body and runs it to its first co_yield (or its end).
  iterator begin() {
    if (handle_) {
      handle_.resume();
      if (handle_.done()) handle_.promise().rethrow_if_failed();
    }
    return iterator(handle_);
  }
  std::default_sentinel_t end() const noexcept { return {}; }

 private:
  handle_type handle_;
};

namespace detail {
template <class T>
generator<T> generator_promise<T>::get_return_object() noexcept {
  return generator<T>(std::coroutine_handle<generator_promise<T>>::from_promise(*this));
}
}  // namespace detail

}  // namespace stagewise::coro
