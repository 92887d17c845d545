#include "stagewise/runtime/c10d/detail/header.hpp"
#include "stagewise/runtime/c10d/env.hpp"
#include "stagewise/runtime/c10d/group.hpp"
#include "stagewise/runtime/c10d/keys.hpp"
#include "stagewise/runtime/c10d/transport.hpp"

#include "tests/support/errors.hpp"
#include "tests/support/multiprocess.hpp"
#include "tests/support/wire_peer.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

// The wire format between ranks (runtime/c10d/detail/header.hpp) and what a receiver checks on
// arrival (detail/arrival.hpp), against a peer that speaks Gloo but not quite stagewise.

namespace rt = stagewise::runtime;
using rt::Message;
using rt::MessageKey;
using stagewise::schedule::TransferKind;
using stagewise::testing::connected;
using stagewise::testing::contains;
using stagewise::testing::cut;
using stagewise::testing::error_of;
using stagewise::testing::first_transfer;
using stagewise::testing::honest;
using stagewise::testing::of;
using stagewise::testing::random_words;
using stagewise::testing::report;
using stagewise::testing::run_ranks;
using stagewise::testing::Sends;
using namespace std::chrono_literals;

namespace {

const std::string kSameBuild =
    "; every rank must run the same stagewise build and pipe, and no other program may talk to "
    "this job's port";
const std::string kSameVersion =
    "; every rank must run the same stagewise version and pipe, and no other program may talk "
    "to this job's port";

}  // namespace

TEST_SUITE("wire format") {
  TEST_CASE("a message's transfers are exactly the bytes its header announces") {
    auto bytes = [](const std::vector<torch::Tensor>& ts) {
      std::vector<std::int64_t> out;
      for (const auto& t : ts) out.push_back(static_cast<std::int64_t>(t.nbytes()));
      return out;
    };
    // Inline: 63 header words, the tensors' bytes, zeros to a multiple of 512, the end mark.
    const auto small = honest({{torch::arange(8, torch::kFloat)}, true});
    CHECK(bytes(small) == std::vector<std::int64_t>{1024});
    const auto* w = small[0].data_ptr<std::int64_t>();
    CHECK(w[0] == ((std::int64_t{0x537748} << 16) | 2));
    CHECK(w[4] == 1024);
    CHECK(w[127] == ((std::int64_t{0x5377} << 48) | 1024));
    CHECK(torch::all(small[0].narrow(0, 67, 60) == 0).item<bool>());  // the padding is zeros
    CHECK(bytes(honest({{}, true})) == std::vector<std::int64_t>{512});
    CHECK(bytes(honest({{torch::rand({16 * 1024})}, true})) == std::vector<std::int64_t>{66048});
    // Apart: a first transfer of 512 bytes, the header's rest with its end mark, each tensor.
    CHECK(bytes(honest({{torch::rand({16 * 1024 + 1})}, true})) ==
          std::vector<std::int64_t>{512, 65540});
    const auto apart = honest({{torch::arange(4, torch::kFloat)}, true}, 0);
    CHECK(bytes(apart) == std::vector<std::int64_t>{512, 16});
    const auto* h = apart[0].data_ptr<std::int64_t>();
    const float last[2] = {2, 3};  // the tensor's last 8 bytes
    std::int64_t tail = 0;
    std::memcpy(&tail, last, sizeof last);
    CHECK(std::vector<std::int64_t>(h, h + 11) ==
          std::vector<std::int64_t>{(std::int64_t{0x537748} << 16) | 2, 11, 1, 1, 512, 1,
                                    static_cast<std::int64_t>(c10::ScalarType::Float), 1, 4, 16,
                                    tail});
    std::vector<torch::Tensor> many(70);  // 75 header words: 63 first, 12 and an end mark after
    CHECK(bytes(honest({many, false})) == std::vector<std::int64_t>{512, 104});
  }

  // Rank 0 sends, under the tags of the activations rank 1 waits for, messages whose bytes are
  // not the ones their headers announce, or headers from another wire format. Rank 1 refuses
  // each with an error naming the sender, the message and the byte counts; no signal, no hang.
  TEST_CASE("every transfer is checked against its header: cut short, announced longer, others") {
    auto r = run_ranks(
        2,
        [](int rank) {
          auto c = connected();
          auto key = [](int m) { return MessageKey{TransferKind::activation, 1, m}; };
          if (rank == 0) {
            Sends send{c, {}};
            // 0: a 1024-byte inline transfer cut after half its 32 bytes of tensor.
            send(cut(honest({{torch::arange(8, torch::kFloat)}, true})[0], 65), 1, key(0));
            // 1: a 128 KiB tensor on its own, cut to half.
            const auto big = honest({{torch::arange(32768, torch::kFloat)}, true});
            send(big[0], 1, key(1));
            send(big[1].narrow(0, 0, 16384), 1, key(1));
            // 2: a tensor of 16 bytes announced as a transfer of 32 (then 32 sent).
            auto longer = honest({{torch::arange(4, torch::kFloat)}, true}, 0);
            longer[0][9] = 32;
            send(longer[0], 1, key(2));
            send(torch::arange(8, torch::kFloat), 1, key(2));
            // 3: a header of 75 words whose second transfer stops after 8 of its 13 words.
            const auto many = honest({std::vector<torch::Tensor>(70), false});
            send(many[0], 1, key(3));
            send(cut(many[1], 8), 1, key(3));
            // 4, 5: headers of wire formats 1 (its mark was "SwHdr") and 3.
            send(first_transfer({0x5377486472, 4, 0, 1}), 1, key(4));
            auto v3 = honest({{torch::ones(2)}, true});
            v3[0][0] = rt::detail::header_mark(3);
            send(v3[0], 1, key(5));
            // 6, 7: random words, and random words behind a version 2 mark.
            send(random_words(), 1, key(6));
            auto marked = random_words();
            marked[0] = rt::detail::header_mark();
            send(marked, 1, key(7));
            // 8: an activation flagged as one tensor, with none.
            send(honest({{}, true})[0], 1, key(8));
            c.store->wait({"victim_done"});
            return;
          }
          rt::C10dTransport t(
              c, [](int s) { return s % 2; }, {}, rt::C10dOptions().timeout(10s));
          t.begin_step(2, 9, 0);
          std::string out;
          for (int m = 0; m < 9; ++m) out += error_of([&] { t.recv(key(m)); }) + "\n";
          c.store->set("victim_done", std::vector<std::uint8_t>{1});
          report(out);
        },
        60s);
    CHECK(of(r, 0).status == 0);
    CHECK(of(r, 1).status == 0);
    const auto from = [](int m) {
      return "rank 0 (for the activation of micro-batch " + std::to_string(m) + " for stage 1)";
    };
    const auto lines = [&] {
      std::vector<std::string> out;
      std::string line;
      for (char ch : of(r, 1).text) {
        if (ch != '\n') {
          line += ch;
        } else {
          out.push_back(line);
          line.clear();
        }
      }
      return out;
    }();
    REQUIRE(lines.size() == 9);
    CHECK(lines[0] == "stagewise: a message from " + from(0) +
                          " is cut short: its header announces a first transfer of 1024 bytes, "
                          "but fewer arrived (its end mark is missing)" +
                          kSameBuild);
    CHECK(lines[1] == "stagewise: a message from " + from(1) +
                          " is cut short: tensor 0 (Float [32768]) should arrive as a transfer of "
                          "131072 bytes, but it ended early (its last bytes are not the ones its "
                          "header announced)" +
                          kSameBuild);
    CHECK(lines[2] == "stagewise: a message header from " + from(2) +
                          " is corrupt: tensor 0 is announced as a transfer of 32 bytes, but "
                          "Float [4] holds 16 (refused before receiving it)" +
                          kSameVersion);
    CHECK(lines[3] == "stagewise: a message from " + from(3) +
                          " is cut short: its header's second transfer should hold 104 bytes, "
                          "but fewer arrived (its end mark is missing)" +
                          kSameBuild);
    for (int v : {1, 3}) {
      CHECK(lines[static_cast<std::size_t>(v == 1 ? 4 : 5)] ==
            "stagewise: a message header from " + from(v == 1 ? 4 : 5) +
                " is in wire format version " + std::to_string(v) +
                ", but this rank reads version 2: every rank must run the same stagewise build "
                "(start-up compares them, runtime::check_same_wire)");
    }
    CHECK(lines[6] == "stagewise: a message header from " + from(6) +
                          " is garbled (no stagewise header mark): every rank must run the same "
                          "stagewise version and pipe, and no other program may talk to this "
                          "job's port");
    CHECK(contains(lines[7], "stagewise: a message header from " + from(7) +
                                 " is corrupt: it announces a first transfer of "));
    CHECK(lines[8] ==
          "stagewise: rank 0 sent the activation of micro-batch 8 for stage 1 with 0 tensors, "
          "flagged as one: a skip, or a batch of one tensor, has exactly one. Refused on arrival; "
          "rank 0 runs another model or stagewise build (every rank must run the same)");
  }

  // Rank 0 sends activations of Float [2, 3] for micro-batches 0 to 4; rank 1 answers with
  // gradients of another shape, dtype or count, none, the right one, and one for micro-batch 5,
  // for which rank 0 sent nothing.
  TEST_CASE("a gradient has its activation's dtype and shape, and answers an activation sent") {
    auto r = run_ranks(
        2,
        [](int rank) {
          auto c = connected();
          auto grad = [](int m) { return MessageKey{TransferKind::gradient, 0, m}; };
          if (rank == 1) {
            c.store->wait({"sent"});  // as a rank of the pipe would, after the activations
            Sends send{c, {}};
            send(honest({{torch::ones({3, 2})}, true})[0], 0, grad(0));
            send(honest({{torch::ones({2, 3}, torch::kDouble)}, true})[0], 0, grad(1));
            send(honest({{torch::ones({2, 3}), torch::ones({2, 3})}, false})[0], 0, grad(2));
            send(honest({{torch::Tensor()}, true})[0], 0, grad(3));
            send(honest({{torch::full({2, 3}, 4.0)}, true})[0], 0, grad(4));
            send(honest({{torch::ones({2, 3})}, true})[0], 0, grad(5));
            c.store->wait({"victim_done"});
            return;
          }
          rt::C10dTransport t(
              c, [](int s) { return s % 2; }, {}, rt::C10dOptions().timeout(10s));
          t.begin_step(2, 6, 0);
          for (int m = 0; m < 5; ++m) {
            t.send({TransferKind::activation, 1, m}, {{torch::ones({2, 3})}, true});
          }
          c.store->set("sent", std::vector<std::uint8_t>{1});
          std::string out;
          for (int m = 0; m < 6; ++m) {
            out += error_of([&] {
              const auto g = t.recv(grad(m)).value();
              if (m == 3) TORCH_CHECK(!g.tensors.at(0).defined(), "no gradient: undefined");
              if (m == 4) TORCH_CHECK(torch::equal(g.tensors.at(0), torch::full({2, 3}, 4.0)));
            });
            out += "\n";
          }
          c.store->set("victim_done", std::vector<std::uint8_t>{1});
          report(out);
        },
        60s);
    CHECK(of(r, 1).status == 0);
    CHECK(of(r, 0).status == 0);
    const std::string rule =
        ": a gradient has a tensor per tensor sent, of its dtype and shape (or none). Refused on "
        "arrival; rank 1 runs another model or stagewise build (every rank must run the same)\n";
    const auto sent = [](int m) {
      return ", but this rank sent it the activation of micro-batch " + std::to_string(m) +
             " for stage 1 with ";
    };
    CHECK(of(r, 0).text ==
          "stagewise: rank 1 sent the gradient of micro-batch 0 for stage 0 with tensor 0 Float "
          "[3, 2]" +
              sent(0) + "tensor 0 Float [2, 3]" + rule +
              "stagewise: rank 1 sent the gradient of micro-batch 1 for stage 0 with tensor 0 "
              "Double [2, 3]" +
              sent(1) + "tensor 0 Float [2, 3]" + rule +
              "stagewise: rank 1 sent the gradient of micro-batch 2 for stage 0 with 2 tensors" +
              sent(2) + "1" + rule + "(no error)\n(no error)\n" +
              "stagewise: rank 1 sent the gradient of micro-batch 5 for stage 0, but this rank "
              "sent it nothing that gradient answers in this step (a gradient comes after the "
              "tensor it is the gradient of). Refused on arrival; rank 1 runs another model or "
              "stagewise build (every rank must run the same)\n");
  }
}
