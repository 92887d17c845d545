#include "stagewise/threads/thread_pool.hpp"
#include "tests/support/threads.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace sw = stagewise;

using sw::testing::settled_thread_count;
using sw::testing::stable_thread_count;
using sw::testing::thread_count;

TEST_SUITE("thread pool") {
  TEST_CASE("runs every index exactly once") {
    sw::ThreadPool pool(3);
    std::vector<std::atomic<int>> runs(100);
    pool.run(runs.size(), [&](std::size_t i) { ++runs[i]; });
    for (const auto& r : runs) CHECK(r == 1);
    pool.run(0, [&](std::size_t) { FAIL("no index to run"); });
  }

  TEST_CASE("size 1 owns no thread and runs everything on the caller, in order") {
    const auto before = stable_thread_count();
    sw::ThreadPool pool(1);
    CHECK(pool.size() == 1);
    CHECK(thread_count() == before);
    std::vector<std::size_t> order;
    std::set<std::thread::id> threads;
    pool.run(5, [&](std::size_t i) {
      order.push_back(i);
      threads.insert(std::this_thread::get_id());
    });
    CHECK(order == std::vector<std::size_t>{0, 1, 2, 3, 4});
    CHECK(threads == std::set<std::thread::id>{std::this_thread::get_id()});
  }

  TEST_CASE("the caller takes part: size 2 runs two tasks at once, one on the caller") {
    sw::ThreadPool pool(2);
    std::mutex mutex;
    std::condition_variable cv;
    int arrived = 0;
    std::vector<int> met(2);
    std::vector<std::thread::id> ids(2);
    pool.run(2, [&](std::size_t i) {
      ids[i] = std::this_thread::get_id();
      std::unique_lock<std::mutex> lock(mutex);
      if (++arrived == 2) cv.notify_all();
      met[i] = cv.wait_for(lock, std::chrono::seconds(2), [&] { return arrived == 2; });
    });
    CHECK(met[0]);
    CHECK(met[1]);
    CHECK(ids[0] != ids[1]);
    CHECK((ids[0] == std::this_thread::get_id() || ids[1] == std::this_thread::get_id()));
  }

  TEST_CASE("the default size is the number of hardware threads") {
    CHECK(sw::ThreadPool::default_size() ==
          std::max<std::size_t>(1, std::thread::hardware_concurrency()));
    CHECK(sw::default_thread_pool()->size() == sw::ThreadPool::default_size());
    CHECK(sw::default_thread_pool() == sw::default_thread_pool());
  }

  TEST_CASE("an exception reaches the caller after the running tasks finished; later ones skip") {
    sw::ThreadPool pool(2);
    std::atomic<int> running{0};
    std::atomic<int> started{0};
    bool caught = false;
    try {
      pool.run(50, [&](std::size_t i) {
        ++started;
        ++running;
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
        --running;
        if (i == 1) throw std::runtime_error("task 1 failed");
      });
    } catch (const std::runtime_error& e) {
      caught = true;
      CHECK(std::string(e.what()) == "task 1 failed");
    }
    CHECK(caught);
    CHECK(running == 0);
    CHECK(started < 50);  // the tasks after the failure were skipped
  }

  TEST_CASE("the exception of the lowest-numbered failed task is rethrown") {
    sw::ThreadPool pool(1);
    std::string message;
    try {
      pool.run(4, [&](std::size_t i) {
        if (i == 2) throw std::runtime_error("task 2");
      });
    } catch (const std::runtime_error& e) {
      message = e.what();
    }
    CHECK(message == "task 2");
    // With several failures among tasks that all ran, the lowest index wins.
    sw::ThreadPool wide(4);
    std::mutex mutex;
    std::condition_variable cv;
    int arrived = 0;
    try {
      wide.run(4, [&](std::size_t i) {
        {
          // All four start before any throws, so none is skipped.
          std::unique_lock<std::mutex> lock(mutex);
          if (++arrived == 4) cv.notify_all();
          cv.wait_for(lock, std::chrono::seconds(2), [&] { return arrived == 4; });
        }
        if (i >= 1) throw std::runtime_error("task " + std::to_string(i));
      });
    } catch (const std::runtime_error& e) {
      message = e.what();
    }
    CHECK(message == "task 1");
  }

  TEST_CASE("a task may run another fork-join on the same pool without deadlock") {
    sw::ThreadPool pool(2);
    std::atomic<int> leaves{0};
    pool.run(4, [&](std::size_t) {
      pool.run(4, [&](std::size_t) { pool.run(3, [&](std::size_t) { ++leaves; }); });
    });
    CHECK(leaves == 48);
  }

  TEST_CASE("destroying a pool joins its threads: no thread is leaked") {
    const auto before = stable_thread_count();
    {
      sw::ThreadPool pool(4);
      CHECK(settled_thread_count(before + 3) == before + 3);
      pool.run(16, [](std::size_t) { std::this_thread::sleep_for(std::chrono::milliseconds(1)); });
    }
    CHECK(settled_thread_count(before) == before);
    {
      sw::ThreadPool pool(3);
      CHECK_THROWS_AS(pool.run(8, [](std::size_t) { throw std::logic_error("x"); }),
                      std::logic_error);
    }
    CHECK(settled_thread_count(before) == before);
  }

  TEST_CASE("size 0 is an error naming the fix") {
    try {
      sw::ThreadPool pool(0);
      FAIL("expected an error");
    } catch (const c10::Error& e) {
      CHECK(std::string(e.what_without_backtrace())
                .find("Use ThreadPool(1) to run tasks one "
                      "after another") != std::string::npos);
    }
  }
}
