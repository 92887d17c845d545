#pragma once

// What a message's receiver checks on arrival, beside its header's words (detail/header.hpp):
// that each transfer brought the bytes its header announced (end marks, announced last bytes),
// and that a reply has the form of what this rank sent for it (a gradient, its activation's).

#include "stagewise/runtime/c10d/detail/header.hpp"
#include "stagewise/runtime/c10d/keys.hpp"
#include "stagewise/runtime/message.hpp"
#include "stagewise/runtime/stream.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

// The tail of the errors for bytes that do not match their header.
inline constexpr const char* kSameBuild =
    "; every rank must run the same stagewise build and pipe, and no other program may talk to "
    "this job's port";

// The receive for a message's first transfer: room for its header and `room` inline bytes, on
// `device`, with word 0 and every word where an end mark can fall cleared, so that a transfer
// that ends early cannot look whole.
inline torch::Tensor first_receive(const torch::Device& device, std::int64_t room) {
  const std::int64_t words = first_bytes(room) / 8;
  if (!device.is_cpu()) {
    return torch::zeros({words}, torch::TensorOptions().dtype(torch::kInt64).device(device));
  }
  auto t = torch::empty({words}, torch::kInt64);
  auto* w = t.data_ptr<std::int64_t>();
  w[0] = 0;
  for (std::int64_t end = kBlockBytes / 8; end <= words; end += kBlockBytes / 8) w[end - 1] = 0;
  return t;
}

// Checks a first transfer that arrived (`cpu`, the whole receive, on the CPU): its mark and wire
// version, the length it announces against the receive, and its end mark there. Returns the
// header's number of words. Errors name the sender (`from()`, made only then).
template <class From>
std::int64_t check_first(const torch::Tensor& cpu, const From& from) {
  const auto* w = cpu.data_ptr<std::int64_t>();
  const std::int64_t posted = cpu.numel() * 8;
  const std::int64_t version = wire_version_of(w[0]);
  TORCH_CHECK(version >= 0, "stagewise: a message header from ", from(),
              " is garbled (no stagewise header mark): every rank must run the same stagewise "
              "version and pipe, and no other program may talk to this job's port");
  TORCH_CHECK(version == kWireVersion, "stagewise: a message header from ", from(),
              " is in wire format version ", version, ", but this rank reads version ",
              kWireVersion,
              ": every rank must run the same stagewise build (start-up compares them, "
              "runtime::check_same_wire)");
  const std::int64_t length = w[4];
  TORCH_CHECK(length >= kBlockBytes && length <= posted && length % kBlockBytes == 0,
              "stagewise: a message header from ", from(), " is corrupt: it announces a first ",
              "transfer of ", length, " bytes, where one is a multiple of ", kBlockBytes,
              " bytes up to the ", posted, " its receive holds", kSameBuild);
  TORCH_CHECK(w[length / 8 - 1] == end_mark(length), "stagewise: a message from ", from(),
              " is cut short: its header announces a first transfer of ", length,
              " bytes, but fewer arrived (its end mark is missing)", kSameBuild);
  TORCH_CHECK(w[1] >= kFixedWords && w[1] <= kMaxHeaderWords, "stagewise: a message header from ",
              from(), " is corrupt: it claims ", w[1], " words (a header has ", kFixedWords, " to ",
              kMaxHeaderWords, "); every rank must run the same stagewise version and pipe");
  return w[1];
}

// The receive for the rest of a header of `words` words (its words past the first transfer's and
// an end mark), the end mark's word cleared.
inline torch::Tensor rest_receive(std::int64_t words, const torch::Device& device) {
  const std::int64_t n = words - kFirstWords + 1;
  if (!device.is_cpu()) {
    return torch::zeros({n}, torch::TensorOptions().dtype(torch::kInt64).device(device));
  }
  auto t = torch::empty({n}, torch::kInt64);
  t.data_ptr<std::int64_t>()[n - 1] = 0;
  return t;
}

template <class From>
void check_rest(const torch::Tensor& cpu, const From& from) {
  const std::int64_t n = cpu.numel();
  TORCH_CHECK(cpu.data_ptr<std::int64_t>()[n - 1] == end_mark(n * 8), "stagewise: a message from ",
              from(), " is cut short: its header's second transfer should hold ", n * 8,
              " bytes, but fewer arrived (its end mark is missing)", kSameBuild);
}

// The last bytes a separate tensor's transfer must end with (at most kTailBytes): the low bytes
// of its announced tail word, as tail_word packs them.
inline std::int64_t tail_length(const TensorMeta& t) {
  return std::min(kTailBytes, t.bytes);
}

// Before a message's separate tensors (`m`, laid out as `l`) are received: writes over each one's
// last bytes the complement of those its header announced, so that a transfer that ends early
// leaves bytes that differ from them. On a GPU, one copy to the device for the whole message.
inline void clear_tails(const Message& m, const Layout& l) {
  std::vector<std::uint8_t> complement;
  std::vector<std::size_t> which;
  for (std::size_t k = 0; k < l.tensors.size(); ++k) {
    const auto& t = l.tensors[k];
    if (!t.separate) continue;
    const auto n = static_cast<std::size_t>(tail_length(t));
    std::uint8_t want[kTailBytes];
    std::memcpy(want, &t.tail, sizeof want);
    if (m.tensors[k].is_cpu()) {
      auto* last = static_cast<std::uint8_t*>(m.tensors[k].data_ptr()) + t.bytes - tail_length(t);
      for (std::size_t b = 0; b < n; ++b) last[b] = static_cast<std::uint8_t>(~want[b]);
      continue;
    }
    for (std::size_t b = 0; b < n; ++b) complement.push_back(static_cast<std::uint8_t>(~want[b]));
    which.push_back(k);
  }
  if (which.empty()) return;
  const auto device = m.tensors[which.front()].device();
  const auto values =
      torch::from_blob(complement.data(), {static_cast<std::int64_t>(complement.size())},
                       torch::kUInt8)
          .to(device);
  std::int64_t at = 0;
  for (const auto k : which) {
    const auto n = tail_length(l.tensors[k]);
    const auto bytes = bytes_of(m.tensors[k]);
    bytes.narrow(0, bytes.numel() - n, n).copy_(values.narrow(0, at, n));
    at += n;
  }
}

// After a message's separate tensors arrived: each ends with the bytes its header announced, or
// the error names it, its byte count and the sender (`from()`). On a GPU, one copy to the host
// for the whole message (it waits for the transfers).
template <class From>
void check_tails(const Message& m, const Layout& l, const From& from) {
  std::vector<std::size_t> which;
  for (std::size_t k = 0; k < l.tensors.size(); ++k) {
    if (l.tensors[k].separate) which.push_back(k);
  }
  if (which.empty()) return;
  torch::Tensor gathered;  // the tails of a GPU message, on the host
  if (!m.tensors[which.front()].is_cpu()) {
    std::int64_t total = 0;
    for (const auto k : which) total += tail_length(l.tensors[k]);
    auto on_device = torch::empty(
        {total},
        torch::TensorOptions().dtype(torch::kUInt8).device(m.tensors[which.front()].device()));
    std::int64_t at = 0;
    for (const auto k : which) {
      const auto n = tail_length(l.tensors[k]);
      const auto bytes = bytes_of(m.tensors[k]);
      on_device.narrow(0, at, n).copy_(bytes.narrow(0, bytes.numel() - n, n));
      at += n;
    }
    gathered = copy_to(on_device, torch::kCPU);
  }
  std::int64_t at = 0;
  for (const auto k : which) {
    const auto& t = l.tensors[k];
    const auto n = tail_length(t);
    const auto* got = gathered.defined()
                          ? gathered.data_ptr<std::uint8_t>() + at
                          : static_cast<const std::uint8_t*>(m.tensors[k].data_ptr()) + t.bytes - n;
    at += n;
    TORCH_CHECK(std::memcmp(got, &t.tail, static_cast<std::size_t>(n)) == 0,
                "stagewise: a message from ", from(), " is cut short: tensor ", k, " (",
                describe(t), ") should arrive as a transfer of ", t.bytes,
                " bytes, but it ended early (its last bytes are not the ones its header "
                "announced)",
                kSameBuild);
  }
}

// Refused on arrival, whatever the model: a skip or a skip's gradient, and an activation or a
// gradient flagged as one tensor (atomic), that does not carry exactly one tensor (the executor
// takes the first). A shared value (stage -1) passes.
inline void check_form(const MessageKey& k, const Layout& l, const std::string& rank) {
  using schedule::TransferKind;
  if (k.stage < 0) return;
  const bool skip = k.kind == TransferKind::skip || k.kind == TransferKind::skip_grad;
  TORCH_CHECK(l.tensors.size() == 1 || !(skip || l.atomic), "stagewise: rank ", rank, " sent ",
              describe(k), " with ", l.tensors.size(), " tensors", skip ? "" : ", flagged as one",
              ": a skip, or a batch of one tensor, has exactly one. Refused on arrival; rank ",
              rank, " runs another model or stagewise build (every rank must run the same)");
}

// What this rank expects back for the messages it sent to other ranks: the gradient of an
// activation (the reply to `{activation, s, m}` is `{gradient, s - 1, m}`) or of a skip has a
// tensor per tensor sent, undefined or of the sent one's dtype and shape. A reply that differs
// is refused on arrival, before anything is allocated for it and before autograd sees it.
class Replies {
 public:
  // Remembers `sent` (sent as `key`) as the form of the reply `reply`.
  void expect(const MessageKey& reply, const MessageKey& key, const Message& sent) {
    Sent s{key, {}};  // the sent message's form
    for (const auto& t : sent.tensors) {
      TensorMeta meta;
      if (t.defined()) {
        meta.defined = true;
        meta.dtype = t.scalar_type();
        meta.sizes = t.sizes().vec();
      }
      s.tensors.push_back(std::move(meta));
    }
    std::lock_guard<std::mutex> lock(mutex_);
    sent_[reply] = std::move(s);
  }

  // Checks the reply `reply` (laid out as `l`) from rank `rank` against what was sent for it,
  // and forgets it. A gradient that answers nothing this rank sent in the step is refused too:
  // a rank of the same program sends one only after it received what it answers. Other
  // messages pass.
  void check(const MessageKey& reply, const Layout& l, const std::string& rank) {
    const auto other_build = [&] {
      return "Refused on arrival; rank " + rank +
             " runs another model or stagewise build (every rank must run the same)";
    };
    Sent s{};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = sent_.find(reply);
      if (it == sent_.end()) {
        TORCH_CHECK(reply.kind != schedule::TransferKind::gradient &&
                        reply.kind != schedule::TransferKind::skip_grad,
                    "stagewise: rank ", rank, " sent ", describe(reply),
                    ", but this rank sent it nothing that gradient answers in this step (a "
                    "gradient comes after the tensor it is the gradient of). ",
                    other_build());
        return;
      }
      s = std::move(it->second);
      sent_.erase(it);
    }
    const auto fail = [&](const std::string& got, const std::string& had) {
      TORCH_CHECK(false, "stagewise: rank ", rank, " sent ", describe(reply), " with ", got,
                  ", but this rank sent it ", describe(s.key), " with ", had,
                  ": a gradient has a tensor per tensor sent, of its dtype and shape (or none). ",
                  other_build());
    };
    if (l.tensors.size() != s.tensors.size()) {
      fail(std::to_string(l.tensors.size()) + " tensors", std::to_string(s.tensors.size()));
    }
    for (std::size_t k = 0; k < l.tensors.size(); ++k) {
      const auto& got = l.tensors[k];
      const auto& had = s.tensors[k];
      if (!got.defined) continue;  // no gradient
      if (!had.defined || got.dtype != had.dtype || got.sizes != had.sizes) {
        fail("tensor " + std::to_string(k) + " " + describe(got),
             "tensor " + std::to_string(k) + " " + describe(had));
      }
    }
  }

  // Forgets every expected reply (a new step).
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    sent_.clear();
  }

 private:
  struct Sent {
    MessageKey key;
    std::vector<TensorMeta> tensors;
  };
  std::mutex mutex_;
  std::unordered_map<MessageKey, Sent> sent_;
};

}  // namespace stagewise::runtime::detail
