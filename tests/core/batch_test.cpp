#include "stagewise/core/batch.hpp"

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <string>

namespace sw = stagewise;

using stagewise::testing::error_of;


TEST_SUITE("batch") {
  TEST_CASE("an atomic batch gives its tensor and index 0, not tensors()") {
    auto x = torch::rand({2});
    sw::Batch b(x);
    CHECK(b.atomic());
    CHECK(b.size() == 1);
    CHECK(b.tensor().is_same(x));
    CHECK(b[0].is_same(x));
    CHECK(error_of([&] { (void)b.tensors(); }).find("is atomic (one tensor), not a tuple") !=
          std::string::npos);
    CHECK(error_of([&] { (void)b[1]; }).find("index 1 is out of range for an atomic batch") !=
          std::string::npos);
  }

  TEST_CASE("a tuple batch gives tensors() and every index, not tensor()") {
    auto x = torch::rand({2});
    auto y = torch::rand({2});
    sw::Batch b({x, y});
    CHECK_FALSE(b.atomic());
    CHECK(b.size() == 2);
    CHECK(b.tensors()[1].is_same(y));
    CHECK(b[0].is_same(x));
    CHECK(error_of([&] { (void)b.tensor(); }).find("is a tuple of 2 tensors, not atomic") !=
          std::string::npos);
    CHECK(error_of([&] { (void)b[2]; }).find("index 2 is out of range for a tuple batch of 2") !=
          std::string::npos);
  }

  TEST_CASE("setting by index and by slice") {
    auto x = torch::zeros({1});
    auto y = torch::ones({1});
    sw::Batch a(x);
    a.set(0, y);
    CHECK(a.tensor().is_same(y));
    a.set({x});
    CHECK(a.tensor().is_same(x));
    CHECK(error_of([&] { a.set({x, y}); }).find("atomic batch holds exactly one tensor, got 2") !=
          std::string::npos);
    CHECK(error_of([&] { a.set(1, y); }).find("out of range") != std::string::npos);

    sw::Batch t({x, x});
    t.set(1, y);
    CHECK(t[1].is_same(y));
    t.set({y, x, y});
    CHECK(t.size() == 3);
    CHECK(t[2].is_same(y));
  }

  TEST_CASE("non-tensor values are rejected with the element's position and kind") {
    CHECK(error_of([] { sw::Batch::from_ivalue(c10::IValue(int64_t{3}), "stage 1"); })
              .find("stage 1 produced a Int, not a Tensor or a tuple of Tensors") !=
          std::string::npos);
    auto tuple = c10::ivalue::Tuple::create({c10::IValue(torch::rand({1})), c10::IValue(2.5)});
    CHECK(error_of([&] { sw::Batch::from_ivalue(c10::IValue(tuple), "stage 0"); })
              .find("element 1 of the tuple from stage 0 is a Double, not a Tensor") !=
          std::string::npos);
    CHECK(error_of([] { sw::Batch(std::vector<torch::Tensor>{}); })
              .find("a tuple batch needs at least one tensor") != std::string::npos);
  }

  TEST_CASE("an IValue round trip keeps the structure") {
    auto x = torch::rand({2});
    auto y = torch::rand({3});
    CHECK(sw::Batch::from_ivalue(sw::Batch(x).to_ivalue()).atomic());
    auto back = sw::Batch::from_ivalue(sw::Batch({x, y}).to_ivalue());
    CHECK_FALSE(back.atomic());
    CHECK(back[1].is_same(y));
  }
}

TEST_SUITE("scatter and gather") {
  TEST_CASE("scatter of a tensor chunks dimension 0") {
    auto x = torch::arange(8).view({4, 2});
    auto micro = sw::scatter(sw::Batch(x), 2);
    REQUIRE(micro.size() == 2);
    CHECK(micro[0].atomic());
    CHECK(micro[0].tensor().equal(x.slice(0, 0, 2)));
    CHECK(micro[1].tensor().equal(x.slice(0, 2, 4)));
  }

  TEST_CASE("scatter of a tuple chunks each tensor") {
    auto a = torch::arange(4);
    auto b = torch::arange(8).view({4, 2});
    auto micro = sw::scatter(sw::Batch({a, b}), 2);
    REQUIRE(micro.size() == 2);
    CHECK_FALSE(micro[1].atomic());
    CHECK(micro[1][0].equal(a.slice(0, 2, 4)));
    CHECK(micro[1][1].equal(b.slice(0, 2, 4)));
  }

  TEST_CASE("indivisible and smaller-than-chunks batches give fewer or uneven micro-batches") {
    auto seven = sw::scatter(sw::Batch(torch::rand({7, 3})), 4);
    REQUIRE(seven.size() == 4);
    CHECK(seven[0].tensor().size(0) == 2);
    CHECK(seven[3].tensor().size(0) == 1);
    auto two = sw::scatter(sw::Batch(torch::rand({2, 3})), 4);
    CHECK(two.size() == 2);
  }

  TEST_CASE("gather of tensors and of tuples inverts scatter") {
    auto x = torch::rand({7, 3});
    CHECK(sw::gather(sw::scatter(sw::Batch(x), 3)).tensor().equal(x));
    auto a = torch::rand({5});
    auto b = torch::rand({5, 2});
    auto back = sw::gather(sw::scatter(sw::Batch({a, b}), 2));
    CHECK_FALSE(back.atomic());
    CHECK(back[0].equal(a));
    CHECK(back[1].equal(b));
  }

  TEST_CASE("bad scatter and gather inputs are clear errors") {
    CHECK(error_of([] { sw::scatter(sw::Batch(torch::rand({2})), 0); })
              .find("chunks must be positive, got 0") != std::string::npos);
    CHECK(error_of([] { sw::scatter(sw::Batch({torch::rand({2}), torch::rand({3})}), 2); })
              .find("tensor 1 has 3 rows but tensor 0 has 2") != std::string::npos);
    CHECK(error_of([] { sw::scatter(sw::Batch(torch::tensor(1.0)), 2); })
              .find("is a scalar") != std::string::npos);
    CHECK(error_of([] { sw::gather({}); }).find("no micro-batches to gather") !=
          std::string::npos);
    CHECK(error_of([] {
            sw::gather({sw::Batch(torch::rand({1})), sw::Batch({torch::rand({1}), torch::rand({1})})});
          }).find("micro-batch 1 has a different structure") != std::string::npos);
  }
}
