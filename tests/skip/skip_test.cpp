// unity: global scope (it specializes stagewise::skip_declarations, which a nested namespace cannot)
#include "stagewise/pipe.hpp"
#include "stagewise/skip/layout.hpp"
#include "stagewise/runtime/detail/portal_tracker.hpp"
#include "stagewise/skip/skippable.hpp"
#include "stagewise/skip/verify.hpp"
#include "stagewise/stage/seq.hpp"

#include <torch/torch.h>

#include "tests/support/errors.hpp"

#include <doctest/doctest.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace sw = stagewise;
using sw::testing::contains;
using sw::testing::error_of;

namespace st {

struct E1 {};
struct E2 {};
struct Tag {};
template <class Ns>
using sx = sw::skip<Ns, "x">;
using sy = sw::skip<E1, "y">;

// A layer stashing its input under skip x of Ns.
template <class Ns>
struct StashImpl : sw::Skippable<StashImpl<Ns>, sw::stashes<sx<Ns>>> {
  torch::Tensor forward(torch::Tensor x) {
    sw::stash<sx<Ns>>(this, x);
    return x;
  }
};
template <class Ns>
using Stash = torch::nn::ModuleHolder<StashImpl<Ns>>;

// A layer adding skip x of Ns to its input.
template <class Ns>
struct PopImpl : sw::Skippable<PopImpl<Ns>, sw::pops<sx<Ns>>> {
  torch::Tensor forward(torch::Tensor x) { return x + sw::pop<sx<Ns>>(this); }
};
template <class Ns>
using Pop = torch::nn::ModuleHolder<PopImpl<Ns>>;

// Declares that it stashes and pops the same skip (wrong, but declarable).
struct StashPopImpl : sw::Skippable<StashPopImpl, sw::stashes<sx<E1>>, sw::pops<sx<E1>>> {
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(StashPop);

// Stashes y, pops x: a different name each way, which is fine.
struct SwapImpl : sw::Skippable<SwapImpl, sw::stashes<sy>, sw::pops<sx<E1>>> {
  torch::Tensor forward(torch::Tensor x) {
    stash<sy>(x);
    return x + pop<sx<E1>>();
  }
};
TORCH_MODULE(Swap);

// Pops y and x of E2 (two sources).
struct PopBothImpl : sw::Skippable<PopBothImpl, sw::pops<sy, sx<E2>>> {
  torch::Tensor forward(torch::Tensor x) { return x + pop<sy>() + pop<sx<E2>>(); }
};
TORCH_MODULE(PopBoth);
struct StashYImpl : sw::Skippable<StashYImpl, sw::stashes<sy>> {
  torch::Tensor forward(torch::Tensor x) {
    stash<sy>(x);
    return x;
  }
};
TORCH_MODULE(StashY);

// Declares stash x but does nothing; stashes y through the unchecked free function.
struct LazyImpl : sw::Skippable<LazyImpl, sw::stashes<sx<E1>>> {
  explicit LazyImpl(bool stash_y = false) : stash_y_(stash_y) {}
  torch::Tensor forward(torch::Tensor x) {
    if (stash_y_) sw::stash<sy>(x);
    return x;
  }
  bool stash_y_;
};
TORCH_MODULE(Lazy);
struct NoPopImpl : sw::Skippable<NoPopImpl, sw::pops<sx<E1>>> {
  explicit NoPopImpl(bool pop_y = false) : pop_y_(pop_y) {}
  torch::Tensor forward(torch::Tensor x) { return pop_y_ ? x + sw::pop<sy>() : x; }
  bool pop_y_;
};
TORCH_MODULE(NoPop);

using Lin = torch::nn::Linear;

// A composite whose child stashes: it declares its skips through a skip_declarations
// specialization (below), so typed pipes see them at compile time.
struct BlockImpl : torch::nn::Module {
  BlockImpl() : stash(register_module("stash", Stash<E1>())) {}
  torch::Tensor forward(torch::Tensor x) { return stash(x) * 2; }
  Stash<E1> stash;
};
TORCH_MODULE(Block);

const sw::SkipInfo& info_x1 = sw::skip_info_of<sx<E1>>;
const sw::SkipInfo& info_x2 = sw::skip_info_of<sx<E2>>;
const sw::SkipInfo& info_y = sw::skip_info_of<sy>;

std::shared_ptr<const sw::detail::SkipLayout> two_stage_layout() {
  return std::make_shared<const sw::detail::SkipLayout>(
      2, std::vector<sw::skip_route>{{0, 1, &info_x1}, {0, 0, &info_y}});
}

}  // namespace st

template <>
struct stagewise::skip_declarations<st::BlockImpl> {
  using stash_list = sw::skip_list<st::sx<st::E1>>;
  using pop_list = sw::skip_list<>;
};

using namespace st;

// ---- names and namespaces ----
static_assert(sw::skip_namespace<E1>);
static_assert(!sw::skip_namespace<int>);
static_assert(sw::skip_type<sx<E1>>);
static_assert(sw::skip_type<sw::tagged_skip<E1, Tag>>);
static_assert(!sw::skip_type<int>);
static_assert(!sw::skip_type<E1>);
static_assert(!std::is_same_v<sx<E1>, sx<E2>>);            // equal names, different namespaces
static_assert(std::is_same_v<sx<E1>, sw::skip<E1, "x">>);  // the same skip spelled twice
static_assert(sx<E1>::name() == "x");

// ---- declarations ----
static_assert(sw::skippable<Stash<E1>>);
static_assert(sw::skippable<StashImpl<E1>>);
static_assert(!sw::skippable<Lin>);
static_assert(!sw::skippable<int>);
static_assert(std::is_same_v<sw::skip_declarations<Swap>::stash_list, sw::detail::type_list<sy>>);
static_assert(std::is_same_v<sw::skip_declarations<Swap>::pop_list, sw::detail::type_list<sx<E1>>>);
static_assert(sw::skip_declaration<sw::stashes<sy>>);
static_assert(!sw::skip_declaration<sy>);

// ---- compile-time verification (each failing case also has a must-not-compile file) ----
static_assert(sw::skips_match<Stash<E1>, Pop<E1>>);                 // matching pair
static_assert(sw::skips_match<Stash<E1>, Lin, Pop<E1>>);            // far
static_assert(sw::skips_match<Lin, Lin>);                           // no skips
static_assert(!sw::skips_match<Stash<E1>>);                         // stash without pop
static_assert(!sw::skips_match<Pop<E1>>);                           // pop without stash
static_assert(!sw::skips_match<Pop<E1>, Stash<E1>>);                // pop before stash
static_assert(!sw::skips_match<Stash<E1>, Stash<E1>, Pop<E1>>);     // stash twice
static_assert(!sw::skips_match<Stash<E1>, Pop<E1>, Pop<E1>>);       // pop twice
static_assert(!sw::skips_match<Stash<E1>, StashPop, Pop<E1>>);      // one layer both
static_assert(sw::skips_match<Stash<E1>, Swap, Pop<E1>> == false);  // y never popped
static_assert(sw::skips_match<Stash<E1>, Swap, PopBoth, Stash<E2>, Pop<E2>> == false);
static_assert(sw::skips_match<Stash<E1>, Stash<E2>, Pop<E2>, Pop<E1>>);
// A layer may stash one name and pop another.
static_assert(
    sw::skips_match<Stash<E1>, Swap, sw::seq<Stash<E2>, PopBoth>>);  // isolated by namespace
static_assert(sw::skips_match<Stash<E1>, Pop<E1>, Stash<E2>, Pop<E2>>);
static_assert(sw::skips_match<sw::seq<Stash<E1>, Lin>, sw::seq<Lin, Pop<E1>>>);  // inside seqs
static_assert(!sw::skips_match<sw::seq<Pop<E1>, Stash<E1>>>);  // order inside a seq
static_assert(sw::skips_match<sw::seq<Stash<E1>, Pop<E1>>>);   // within one stage
static_assert(sw::skips_match<Stash<E1>, sw::seq<sw::seq<Stash<E2>, Pop<E2>>, Pop<E1>>>);
static_assert(sw::skips_match<Block, Pop<E1>>);  // declared by specialization
static_assert(!sw::skips_match<Block>);

// ---- compile-time layout ----
namespace layout_checks {
using none = sw::skip_layout<Lin, Lin>;
static_assert(none::num_copies() == 0 && none::routes().size() == 0);

using inner = sw::skip_layout<sw::seq<Stash<E1>, Pop<E1>>, Lin>;
static_assert(inner::route<sx<E1>>() == sw::skip_route{0, 0, &info_x1});
static_assert(!inner::route<sx<E1>>().requires_copy());
static_assert(inner::num_copies() == 0 && inner::copies_into<0>().size() == 0);

using adjoining = sw::skip_layout<Stash<E1>, Pop<E1>>;
static_assert(adjoining::route<sx<E1>>() == sw::skip_route{0, 1, &info_x1});
static_assert(adjoining::copies_into<0>().size() == 0);
static_assert(adjoining::copies_into<1>() == std::array{sw::skip_route{0, 1, &info_x1}});

using far = sw::skip_layout<Stash<E1>, Lin, Pop<E1>>;
static_assert(far::route<sx<E1>>() == sw::skip_route{0, 2, &info_x1});
static_assert(far::copies_into<1>().size() == 0);
static_assert(far::copies_into<2>() == std::array{sw::skip_route{0, 2, &info_x1}});

// Two sources into stage 2; stage 1's skip is stashed first, the result is still by source.
using two_sources = sw::skip_layout<StashY, Stash<E2>, PopBoth>;
static_assert(two_sources::copies_into<2>() ==
              std::array{sw::skip_route{0, 2, &info_y}, sw::skip_route{1, 2, &info_x2}});
using two_sources_reversed = sw::skip_layout<sw::seq<Stash<E2>>, StashY, PopBoth>;
static_assert(two_sources_reversed::copies_into<2>() ==
              std::array{sw::skip_route{0, 2, &info_x2}, sw::skip_route{1, 2, &info_y}});

// Equal names in different namespaces are routed separately.
using unet = sw::skip_layout<Stash<E1>, Stash<E2>, Pop<E2>, Pop<E1>>;
static_assert(unet::route<sx<E1>>() == sw::skip_route{0, 3, &info_x1});
static_assert(unet::route<sx<E2>>() == sw::skip_route{1, 2, &info_x2});
static_assert(unet::copies_into<3>() == std::array{sw::skip_route{0, 3, &info_x1}});
static_assert(std::is_same_v<sw::Pipe<Stash<E1>, Pop<E1>>::skip_layout_type, adjoining>);
}  // namespace layout_checks

TEST_SUITE("skip names") {
  TEST_CASE("a skip is described by its name and namespace, a tag by its type") {
    CHECK(info_x1.describe() == "'x' in namespace st::E1");
    CHECK(sw::skip_info_of<sw::tagged_skip<E2, Tag>>.describe() == "'st::Tag' in namespace st::E2");
    CHECK(&info_x1 != &info_x2);
    CHECK(&info_x1 == &sw::skip_info_of<sw::skip<E1, "x">>);
  }
}

TEST_SUITE("skip layout at run time") {
  // The run-time layout of a Sequential split by a balance, as (stash, pop) pairs into stage j.
  auto copies = [](const sw::Pipe<>& pipe, std::size_t j) {
    std::vector<std::pair<std::size_t, std::string>> out;
    for (const auto& r : pipe->skip_layout().copies_into(j)) {
      out.emplace_back(r.stash_stage, r.skip->describe());
    }
    return out;
  };

  TEST_CASE("no skips, and skips inside one stage, need no copies") {
    auto none = sw::Pipe(torch::nn::Sequential(Lin(1, 1), Lin(1, 1)), sw::balance{1, 1});
    CHECK(none->skip_layout().empty());
    auto inner =
        sw::Pipe(torch::nn::Sequential(Stash<E1>(), Pop<E1>(), Lin(1, 1)), sw::balance{2, 1});
    CHECK_FALSE(inner->skip_layout().has_copies());
    CHECK(inner->skip_layout().find(info_x1)->stash_stage == 0);
    CHECK(inner->skip_layout().find(info_x1)->pop_stage == 0);
  }

  TEST_CASE("adjoining and far skips route from the stashing stage to the popping stage") {
    auto adjoining = sw::Pipe(torch::nn::Sequential(Stash<E1>(), Pop<E1>()), sw::balance{1, 1});
    CHECK(copies(adjoining, 0).empty());
    CHECK(copies(adjoining, 1) ==
          std::vector<std::pair<std::size_t, std::string>>{{0, info_x1.describe()}});
    auto far =
        sw::Pipe(torch::nn::Sequential(Stash<E1>(), Lin(1, 1), Pop<E1>()), sw::balance{1, 1, 1});
    CHECK(copies(far, 1).empty());
    CHECK(copies(far, 2) ==
          std::vector<std::pair<std::size_t, std::string>>{{0, info_x1.describe()}});
  }

  TEST_CASE("pops from two stages are copied sorted by source") {
    auto pipe =
        sw::Pipe(torch::nn::Sequential(Stash<E2>(), StashY(), PopBoth()), sw::balance{1, 1, 1});
    CHECK(copies(pipe, 2) == std::vector<std::pair<std::size_t, std::string>>{
                                 {0, info_x2.describe()}, {1, info_y.describe()}});
  }

  TEST_CASE("namespaces keep equal names apart") {
    auto pipe = sw::Pipe(torch::nn::Sequential(Stash<E1>(), Stash<E2>(), Pop<E2>(), Pop<E1>()),
                         sw::balance{1, 1, 1, 1});
    CHECK(copies(pipe, 2) ==
          std::vector<std::pair<std::size_t, std::string>>{{1, info_x2.describe()}});
    CHECK(copies(pipe, 3) ==
          std::vector<std::pair<std::size_t, std::string>>{{0, info_x1.describe()}});
  }

  TEST_CASE("a composite's child skips are found at run time and routed") {
    auto pipe = sw::Pipe(sw::stages(Block(), Pop<E1>()), sw::PipeOptions().chunks(2));
    CHECK(pipe->skip_layout().find(info_x1)->stash_stage == 0);
    CHECK(pipe->skip_layout().find(info_x1)->pop_stage == 1);
    auto x = torch::rand({4, 1});
    CHECK(pipe->forward(x).equal(x * 3));
  }

  TEST_CASE("a typed pipe's run-time layout equals its compile-time layout") {
    auto pipe = sw::Pipe(sw::stages(sw::seq(Stash<E1>(), Stash<E2>()), Pop<E2>(), Pop<E1>()));
    using L = decltype(pipe)::skip_layout_type;
    CHECK(*pipe->skip_layout().find(info_x1) == L::route<sx<E1>>());
    CHECK(*pipe->skip_layout().find(info_x2) == L::route<sx<E2>>());
  }
}

TEST_SUITE("portal tracker") {
  TEST_CASE("tensor life without checkpointing: 1 after the stash, 0 after the pop") {
    sw::runtime::detail::PortalTracker tracker(two_stage_layout());
    auto blue = tracker.save(info_x1, torch::tensor({2.0}));
    CHECK(blue.defined());
    REQUIRE(tracker.portal(info_x1) != nullptr);
    CHECK(tracker.portal(info_x1)->tensor_life() == 1);
    auto y = tracker.load(info_x1, sw::phony());
    CHECK(y.equal(torch::tensor({2.0})));
    CHECK(tracker.portal(info_x1)->tensor_life() == 0);
    CHECK_FALSE(tracker.portal(info_x1)->has_tensor());
  }

  TEST_CASE("tensor life under checkpointing 2/1, and 0/0 while recomputing") {
    sw::runtime::detail::PortalTracker tracker(two_stage_layout());
    const auto t = torch::tensor({2.0});
    {
      auto scope = sw::detail::checkpointing_scope();
      tracker.save(info_x1, t);
    }
    CHECK(tracker.portal(info_x1)->tensor_life() == 2);
    {
      auto scope = sw::detail::checkpointing_scope();
      tracker.load(info_x1, sw::phony());
    }
    CHECK(tracker.portal(info_x1)->tensor_life() == 1);
    CHECK(tracker.portal(info_x1)->has_tensor());  // kept for the recompute
    {
      auto scope = sw::detail::recomputing_scope();
      CHECK(tracker.load(info_x1, sw::phony()).equal(t));
    }
    CHECK(tracker.portal(info_x1)->tensor_life() == 0);
    {
      auto scope = sw::detail::recomputing_scope();
      tracker.save(info_x1, t);
    }
    CHECK(tracker.portal(info_x1)->tensor_life() == 0);
    CHECK_FALSE(tracker.portal(info_x1)->has_tensor());
  }

  TEST_CASE("a second stash of the same skip reuses the portal") {
    sw::runtime::detail::PortalTracker tracker(two_stage_layout());
    tracker.save(info_x1, torch::tensor({1.0}));
    auto* first = tracker.portal(info_x1);
    tracker.save(info_x1, torch::tensor({2.0}));
    CHECK(tracker.portal(info_x1) == first);
  }

  TEST_CASE("a skip within one stage gets no portal; a crossing one does") {
    sw::runtime::detail::PortalTracker tracker(two_stage_layout());
    tracker.save(info_x1, torch::tensor({1.0}));
    CHECK_FALSE(tracker.save(info_y, torch::tensor({2.0})).defined());
    CHECK(tracker.portal(info_x1) != nullptr);
    CHECK_FALSE(tracker.holds_plainly(info_x1));
    CHECK(tracker.portal(info_y) == nullptr);
    CHECK(tracker.holds_plainly(info_y));
    CHECK(tracker.load(info_y, sw::phony()).equal(torch::tensor({2.0})));
  }

  TEST_CASE("an undefined stash creates no portal and pops as undefined") {
    sw::runtime::detail::PortalTracker tracker(two_stage_layout());
    CHECK_FALSE(tracker.save(info_x1, torch::Tensor()).defined());
    CHECK(tracker.portal(info_x1) == nullptr);
    CHECK_FALSE(tracker.load(info_x1, sw::phony()).defined());
  }
}

TEST_SUITE("stash and pop outside a pipe") {
  TEST_CASE("stash then pop returns the stashed tensor, through this thread's plain tracker") {
    auto x = torch::rand({2});
    Stash<E1> stash;
    Pop<E1> pop;
    auto y = pop->forward(stash->forward(x));
    CHECK(y.equal(x * 2));
    CHECK(sw::SkipTracker::of_this_thread().size() == 0);
    CHECK(dynamic_cast<sw::SkipTracker*>(&sw::current_skip_tracker()) ==
          &sw::SkipTracker::of_this_thread());
    CHECK(sw::runtime::detail::PortalCell::current() == nullptr);  // no portal outside a pipe
  }

  TEST_CASE("each thread has its own tracker") {
    sw::stash<sx<E1>>(torch::ones({1}));
    bool seen_elsewhere = true;
    std::thread([&] {
      seen_elsewhere = sw::SkipTracker::of_this_thread().contains(info_x1);
    }).join();
    CHECK_FALSE(seen_elsewhere);
    CHECK(sw::pop<sx<E1>>().equal(torch::ones({1})));
  }

  TEST_CASE("an installed tracker takes the stashes") {
    sw::SkipTracker mine;
    {
      sw::UseSkipTracker use(mine);
      sw::stash<sy>(torch::zeros({1}));
    }
    CHECK(mine.contains(info_y));
    CHECK_FALSE(sw::SkipTracker::of_this_thread().contains(info_y));
  }

  TEST_CASE("popping what was not stashed is an error naming the skip") {
    const auto message = error_of([] { sw::pop<sy>(); });
    CHECK(contains(message,
                   "stagewise::pop: skip 'y' in namespace st::E1 has "
                   "not been stashed"));
  }

  TEST_CASE(
      "declaring but not using, stashing or popping undeclared: errors naming layer and skip") {
    auto run = [](auto layer) {
      auto s = sw::seq(layer);
      return error_of([&] { s->forward(torch::zeros({1})); });
    };
    CHECK(contains(run(Lazy()),
                   "stagewise: st::LazyImpl declares that it stashes skip 'x' in "
                   "namespace st::E1 but did not stash it"));
    CHECK(contains(run(NoPop()),
                   "stagewise: st::NoPopImpl declares that it pops skip 'x' in namespace "
                   "st::E1 but did not pop it"));
    CHECK(contains(run(Lazy(true)),
                   "stagewise::stash: st::LazyImpl stashes skip 'y' in namespace "
                   "st::E1, which it does not declare. Add it "
                   "to the layer's stagewise::stashes<...>."));
    CHECK(contains(run(NoPop(true)),
                   "stagewise::pop: st::NoPopImpl pops skip 'y' in namespace "
                   "st::E1, which it does not declare"));
    sw::SkipTracker::of_this_thread().clear();
  }
}

TEST_SUITE("verification of a Sequential") {
  auto message_of = [](torch::nn::Sequential seq) {
    return error_of([&] { sw::Pipe(seq, sw::balance{static_cast<int64_t>(seq->size())}); });
  };

  TEST_CASE("matching pairs pass, also when isolated by namespaces") {
    CHECK(message_of(torch::nn::Sequential(Stash<E1>(), Pop<E1>())) == "(no error)");
    CHECK(message_of(torch::nn::Sequential(Stash<E1>(), Stash<E2>(), Pop<E2>(), Pop<E1>())) ==
          "(no error)");
    CHECK(message_of(torch::nn::Sequential(Stash<E1>(), Pop<E1>(), Stash<E2>(), Pop<E2>())) ==
          "(no error)");
  }

  TEST_CASE("stash without pop names the layer and the skip") {
    CHECK(contains(message_of(torch::nn::Sequential(Lin(1, 1), Stash<E1>())),
                   "* stage 0, layer '1' (st::StashImpl<st::E1>) stashes skip 'x' "
                   "in namespace st::E1, but no later layer pops it. Add "
                   "stagewise::pops<...>"));
  }

  TEST_CASE("pop without stash names the layer and the skip") {
    CHECK(contains(message_of(torch::nn::Sequential(Pop<E1>())),
                   "* stage 0, layer '0' (st::PopImpl<st::E1>) pops skip 'x' in "
                   "namespace st::E1, but no earlier layer stashes it"));
  }

  TEST_CASE("stash twice and pop twice name both layers") {
    CHECK(contains(message_of(torch::nn::Sequential(Stash<E1>(), Stash<E1>(), Pop<E1>())),
                   "layer '1' (st::StashImpl<st::E1>) stashes skip 'x' in namespace "
                   "st::E1 again (first stashed by stage 0, layer '0'"));
    CHECK(contains(message_of(torch::nn::Sequential(Stash<E1>(), Pop<E1>(), Pop<E1>())),
                   "layer '2' (st::PopImpl<st::E1>) pops skip 'x' in namespace "
                   "st::E1 again (first popped by stage 0, layer '1'"));
  }

  TEST_CASE("stash and pop of one skip in one layer") {
    CHECK(contains(message_of(torch::nn::Sequential(StashPop())),
                   "layer '0' (st::StashPopImpl) stashes and pops skip 'x' in namespace st::E1; a "
                   "layer cannot pop its own stash"));
  }

  TEST_CASE("every problem is collected into one message") {
    const auto message = message_of(torch::nn::Sequential(Pop<E2>(), Stash<E1>(), Stash<E1>()));
    CHECK(contains(message,
                   "stagewise::Pipe: the stashes and pops of its layers do not match (3 "
                   "problems):"));
    CHECK(contains(message, "pops skip 'x' in namespace st::E2, but no earlier"));
    CHECK(contains(message, "again (first stashed by"));
    CHECK(contains(message, "but no later layer pops it"));
  }

  TEST_CASE("a layer may stash one name and pop another; order matters") {
    CHECK(message_of(torch::nn::Sequential(Stash<E1>(), Swap(), Stash<E2>(), PopBoth())) ==
          "(no error)");
    CHECK(contains(message_of(torch::nn::Sequential(Stash<E1>(), PopBoth(), Swap(), Stash<E2>())),
                   "(4 problems)"));  // y and x of E2 popped before stashed, then never popped
  }
}
