#pragma once

#include "stagewise/runtime/message.hpp"
#include "stagewise/runtime/stream.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace stagewise::runtime::detail {

// How a message travels between ranks (transfers_of sends, decode_header reads): its metadata,
// sent ahead of its tensors so that the receiver allocates them
// without being told shapes in advance: [magic, words, tensors, flags, then per tensor: defined,
// dtype, ndim, sizes...]. The first kHeaderWords words always travel (one receive posted before
// the sender sends); a longer header continues in a second message of words - kHeaderWords words.
//
// Over Gloo (a CPU transport) that first receive has room for kInlineBytes more, and a message
// whose header fits the first kHeaderWords words and whose tensors fit that room travels whole in
// it, header and data (flag kInlineFlag): one transfer instead of one per tensor, with no second
// receive posted after the header arrives, whose round trip and wake-ups would cost more than
// copying 64 KiB. (Gloo takes a message shorter than the receive's buffer; NCCL needs the exact
// size, so a GPU transport sends every tensor on its own.) The room is a constant of the wire
// format, not an option: a message longer than the receive posted for it is fatal inside Gloo's
// I/O thread, so every rank must give the same room. Each receive posted ahead holds it until its
// message arrives: about 4 MiB for 32 micro-batches of activations and gradients.
inline constexpr std::int64_t kHeaderMagic = 0x5377486472;  // "SwHdr"
inline constexpr std::int64_t kHeaderWords = 64;
inline constexpr std::int64_t kInlineBytes = 64 * 1024;
inline constexpr std::int64_t kTupleFlag = 1;   // Message::atomic
inline constexpr std::int64_t kInlineFlag = 2;  // the tensors' bytes follow the header's words

inline std::vector<std::int64_t> encode_header(const Message& m) {
  std::vector<std::int64_t> h{kHeaderMagic, 0, static_cast<std::int64_t>(m.tensors.size()),
                              m.atomic ? kTupleFlag : 0};
  for (const auto& t : m.tensors) {
    h.push_back(t.defined() ? 1 : 0);
    if (!t.defined()) continue;
    h.push_back(static_cast<std::int64_t>(t.scalar_type()));
    h.push_back(t.dim());
    for (auto s : t.sizes()) h.push_back(s);
  }
  h[1] = static_cast<std::int64_t>(h.size());
  return h;
}

// The bytes of `m`'s tensors: what traffic() counts, and what must fit the inline room.
inline std::int64_t payload_bytes(const Message& m) {
  std::int64_t bytes = 0;
  for (const auto& t : m.tensors) {
    if (t.defined()) bytes += static_cast<std::int64_t>(t.nbytes());
  }
  return bytes;
}

// The transfers that carry `m` to another rank, in the order they are sent under its tag, on
// `device` (copied there through copy_to, on the calling thread's streams). Where the header fits
// kHeaderWords and the tensors fit `inline_room` (0: never), one transfer: the header flagged
// inline, then the tensors' bytes one after another. Else the header's first kHeaderWords words,
// the rest of the header if longer, and each non-empty tensor.
inline std::vector<torch::Tensor> transfers_of(const Message& m, const torch::Device& device,
                                               std::int64_t inline_room) {
  auto words = encode_header(m);
  const std::int64_t bytes = payload_bytes(m);
  if (static_cast<std::int64_t>(words.size()) <= kHeaderWords && bytes <= inline_room) {
    words[3] |= kInlineFlag;
    auto first = torch::empty({kHeaderWords + (bytes + 7) / 8}, torch::kInt64);
    auto* w = first.data_ptr<std::int64_t>();
    std::fill(std::copy(words.begin(), words.end(), w), w + kHeaderWords, 0);
    auto* payload = reinterpret_cast<char*>(w + kHeaderWords);
    for (const auto& t : m.tensors) {
      if (!t.defined() || t.numel() == 0) continue;
      const auto c = copy_to(t.detach(), torch::kCPU).contiguous();  // a GPU stage's, over Gloo
      std::memcpy(payload, c.data_ptr(), c.nbytes());
      payload += c.nbytes();
    }
    return {first};
  }
  std::vector<torch::Tensor> out;
  auto header =
      torch::zeros({std::max<std::int64_t>(kHeaderWords, static_cast<std::int64_t>(words.size()))},
                   torch::kInt64);
  std::copy(words.begin(), words.end(), header.data_ptr<std::int64_t>());
  out.push_back(copy_to(header.narrow(0, 0, kHeaderWords), device));
  if (header.numel() > kHeaderWords) {
    out.push_back(copy_to(
        header.narrow(0, kHeaderWords, header.numel() - kHeaderWords).contiguous(), device));
  }
  for (const auto& t : m.tensors) {
    if (t.defined() && t.numel() > 0) out.push_back(copy_to(t.detach(), device).contiguous());
  }
  return out;
}

// What a header may describe at most: a sender that is not a rank of this pipe (another job on
// the same port, a truncated frame) is refused before anything is allocated.
inline constexpr std::int64_t kMaxHeaderWords = 1 << 16;
inline constexpr std::int64_t kMaxTensors = 4096;
inline constexpr std::int64_t kMaxDims = 64;

// Words still to receive after the fixed-size part, from its second word; `from()` names the
// sender in errors ("rank 1 (for the activation of micro-batch 0 for stage 1)"), made only then.
template <class From>
std::int64_t header_rest(const torch::Tensor& fixed, const From& from) {
  const auto* w = fixed.data_ptr<std::int64_t>();
  TORCH_CHECK(w[0] == kHeaderMagic, "stagewise: a message header from ", from(),
              " is garbled (no stagewise header mark): every rank must run the same stagewise "
              "version and pipe, and no other program may talk to this job's port");
  TORCH_CHECK(w[1] >= 4 && w[1] <= kMaxHeaderWords, "stagewise: a message header from ", from(),
              " is corrupt: it claims ", w[1], " words (a header has 4 to ", kMaxHeaderWords,
              "); every rank must run the same stagewise version and pipe");
  return w[1] > kHeaderWords ? w[1] - kHeaderWords : 0;
}

// Whether a sender may name this dtype: the ones a stage can send.
inline bool sendable_dtype(std::int64_t d) {
  using c10::ScalarType;
  for (auto t : {ScalarType::Byte, ScalarType::Char, ScalarType::Short, ScalarType::Int,
                 ScalarType::Long, ScalarType::Half, ScalarType::Float, ScalarType::Double,
                 ScalarType::ComplexHalf, ScalarType::ComplexFloat, ScalarType::ComplexDouble,
                 ScalarType::Bool, ScalarType::BFloat16}) {
    if (d == static_cast<std::int64_t>(t)) return true;
  }
  return false;
}

// Whether the header `h` says its tensors' bytes follow it in the same transfer.
inline bool inline_payload(const std::vector<std::int64_t>& h) {
  return h.size() > 3 && (h[3] & kInlineFlag) != 0;
}

// The message with empty tensors of the right dtypes and shapes (undefined where undefined). Every
// word is checked before anything is allocated (a first pass): the tensor count, each defined
// flag, dtype, dimension count and size, the header's length, and the message's bytes against
// `max_bytes`, or against `inline_room` (0 where nothing travels inline) for a message whose
// bytes follow the header; a bad one is an error naming the sender (`from()`, made only then).
template <class From>
Message decode_header(const std::vector<std::int64_t>& h, const torch::Device& device,
                      std::int64_t max_bytes, std::int64_t inline_room, const From& from) {
  const auto corrupt = [&](const std::string& why) {
    TORCH_CHECK(false, "stagewise: a message header from ", from(), " is corrupt: ", why,
                "; every rank must run the same stagewise version and pipe, and no other "
                "program may talk to this job's port");
  };
  // The fixed part travels whole: words past the header's own length are padding.
  if (h.size() < 4 || h[1] < 4 || h[1] > static_cast<std::int64_t>(h.size())) {
    corrupt("its length does not match its words");
  }
  const std::int64_t n = h[1];
  if (h[2] < 0 || h[2] > kMaxTensors) {
    corrupt("it claims " + std::to_string(h[2]) + " tensors (at most " +
            std::to_string(kMaxTensors) + ")");
  }
  if (h[3] < 0 || h[3] > (kTupleFlag | kInlineFlag)) {
    corrupt("its flags word is " + std::to_string(h[3]));
  }
  const auto word = [&](std::int64_t at) { return h[static_cast<std::size_t>(at)]; };
  std::int64_t at = 4;
  double bytes = 0;  // in double: a corrupt size cannot overflow it past the check
  for (std::int64_t k = 0; k < h[2]; ++k) {
    const auto which = [k] { return "tensor " + std::to_string(k); };
    if (at >= n) corrupt(which() + " is cut off");
    const auto defined = word(at++);
    if (defined != 0 && defined != 1) {
      corrupt(which() + "'s defined flag is " + std::to_string(defined));
    }
    if (defined == 0) continue;
    if (at + 2 > n) corrupt(which() + " is cut off");
    const auto dtype = word(at++);
    if (!sendable_dtype(dtype)) corrupt(which() + " has unknown dtype " + std::to_string(dtype));
    const auto ndim = word(at++);
    if (ndim < 0 || ndim > kMaxDims) {
      corrupt(which() + " claims " + std::to_string(ndim) + " dimensions (at most " +
              std::to_string(kMaxDims) + ")");
    }
    if (at + ndim > n) corrupt(which() + " is cut off");
    double elements = 1;
    for (std::int64_t d = 0; d < ndim; ++d) {
      const auto size = word(at++);
      if (size < 0) corrupt(which() + " has size " + std::to_string(size));
      elements *= static_cast<double>(size);
    }
    bytes += elements * static_cast<double>(c10::elementSize(static_cast<c10::ScalarType>(dtype)));
  }
  if (at != n) corrupt("it has " + std::to_string(n - at) + " words beyond its tensors");
  if (inline_payload(h) && (n > kHeaderWords || bytes > static_cast<double>(inline_room))) {
    corrupt("it claims " + std::to_string(static_cast<std::int64_t>(bytes)) +
            " bytes inline, where a first transfer holds " + std::to_string(inline_room) +
            " after a header of at most " + std::to_string(kHeaderWords) + " words");
  }
  TORCH_CHECK(bytes <= static_cast<double>(max_bytes), "stagewise: a message from ", from(),
              " would need ", bytes, " bytes, above the limit of ", max_bytes,
              " bytes per message (C10dOptions::max_message_bytes): raise the limit if a stage "
              "really sends that much, else the sender is not a rank of this pipe");
  // Every word is sound: the second pass allocates.
  Message m;
  m.atomic = (h[3] & kTupleFlag) != 0;
  at = 4;
  for (std::int64_t k = 0; k < h[2]; ++k) {
    if (word(at++) == 0) {
      m.tensors.emplace_back();
      continue;
    }
    const auto dtype = static_cast<c10::ScalarType>(word(at++));
    const auto ndim = word(at++);
    std::vector<std::int64_t> sizes(h.begin() + at, h.begin() + at + ndim);
    at += ndim;
    m.tensors.push_back(torch::empty(sizes, torch::TensorOptions().dtype(dtype).device(device)));
  }
  return m;
}

}  // namespace stagewise::runtime::detail
