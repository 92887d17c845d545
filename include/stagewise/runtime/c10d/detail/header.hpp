#pragma once

// The wire format of a message between ranks (version kWireVersion): how transfers_of lays a
// message out in transfers, and how parse_header reads and checks the header the receiver got.

#include "stagewise/runtime/message.hpp"
#include "stagewise/runtime/stream.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

namespace stagewise::runtime::detail {

// A message's metadata travels ahead of its tensors, so that the receiver allocates them without
// being told shapes in advance. Its words: [mark | version, words, tensors, flags, first
// transfer's bytes, then per tensor: defined, dtype, ndim, sizes..., and for a tensor that
// travels on its own: its transfer's bytes and its last (at most 8) bytes].
//
// The first transfer is a receive posted before the sender sends, of a size fixed by the wire
// format: the header's first kFirstWords words, then (flag kInlineFlag) the tensors' bytes one
// after another, then zeros up to a multiple of kBlockBytes whose last word is the end mark
// (end_mark(its length)). A longer header continues in a second transfer (its other words and an
// end mark), and each non-empty tensor not inline travels on its own, of exactly the bytes the
// header announces. So every transfer's size is known to the receiver before it posts the
// receive, and is checked on arrival: a transfer that ends early misses its end mark (the
// receiver cleared every place one can fall), or, for a tensor sent from its own memory, ends
// with other bytes than the last ones its header announced (the receiver wrote their complement
// there first). Gloo takes a transfer shorter than its receive without a word; one longer than
// its receive is fatal inside Gloo's I/O thread, so the receiver never posts one smaller than the
// sender announced, and refuses a header whose announced sizes disagree with its shapes before
// posting anything for them.
//
// Over Gloo (a CPU transport) the first receive has room for kInlineBytes of tensors: a message
// whose header fits kFirstWords and whose tensors fit the room travels whole in one transfer,
// with no second receive posted after the header arrives, whose round trip and wake-ups would
// cost more than copying 64 KiB. (NCCL needs the exact size, so a GPU transport sends every
// tensor on its own, and its first transfer is always kBlockBytes.) The room is part of the wire
// format, compared at start-up (runtime::check_same_wire). Each receive posted ahead holds it
// until its message arrives: about 4 MiB for 32 micro-batches of activations and gradients.
inline constexpr std::int64_t kWireVersion = 2;
inline constexpr std::int64_t kWireMark = 0x537748;    // "SwH": word 0 is kWireMark << 16 | version
inline constexpr std::int64_t kVersion1Bits = 0x6472;  // version 1's word 0 was "SwHdr"
inline constexpr std::int64_t kHeaderWords = 64;       // the first transfer's header block
inline constexpr std::int64_t kFirstWords = kHeaderWords - 1;  // header words it carries
inline constexpr std::int64_t kBlockBytes = 512;  // a first transfer is a multiple of this
inline constexpr std::int64_t kInlineBytes = 64 * 1024;
inline constexpr std::int64_t kFixedWords = 5;  // the words before the tensors'
inline constexpr std::int64_t kTupleFlag = 1;   // Message::atomic
inline constexpr std::int64_t kInlineFlag = 2;  // the tensors' bytes follow the header's words
inline constexpr std::int64_t kTailBytes = 8;   // a tensor's last bytes, announced in its header

// The layout above in words, which ranks compare at start-up (runtime::check_same_wire): change it
// with the layout.
inline constexpr const char* kHeaderLayout =
    "first transfer: 63 header words, inline bytes, zeros, end mark, in 512-byte blocks; words: "
    "mark|version, words, tensors, flags, first bytes, per tensor: defined, dtype, ndim, sizes, "
    "and for a separate one its bytes and last 8 bytes";

// What a header may describe at most: a sender that is not a rank of this pipe (another job on
// the same port, a truncated frame) is refused before anything is allocated.
inline constexpr std::int64_t kMaxHeaderWords = 1 << 16;
inline constexpr std::int64_t kMaxTensors = 4096;
inline constexpr std::int64_t kMaxDims = 64;

// A header's word 0, and the version a word 0 names (-1: not a stagewise header).
inline constexpr std::int64_t header_mark(std::int64_t version = kWireVersion) {
  return (kWireMark << 16) | version;
}
inline std::int64_t wire_version_of(std::int64_t word0) {
  if ((word0 >> 16) != kWireMark) return -1;
  const std::int64_t bits = word0 & 0xffff;
  return bits == kVersion1Bits ? 1 : bits;
}

// The last word of a transfer stagewise lays out itself, `bytes` long: never zero (its top byte
// is 0x53), so a receive cleared to zeros tells it from a transfer that ended early.
inline constexpr std::int64_t end_mark(std::int64_t bytes) {
  return (std::int64_t{0x5377} << 48) | bytes;
}

// The bytes of a first transfer that carries `inline_bytes` of tensors (0: none); for the room of
// a receive, the most it can be.
inline constexpr std::int64_t first_bytes(std::int64_t inline_bytes) {
  const std::int64_t used = kFirstWords * 8 + inline_bytes + 8;
  return (used + kBlockBytes - 1) / kBlockBytes * kBlockBytes;
}

// The bytes of `m`'s tensors: what traffic() counts, and what must fit the inline room.
inline std::int64_t payload_bytes(const Message& m) {
  std::int64_t bytes = 0;
  for (const auto& t : m.tensors) {
    if (t.defined()) bytes += static_cast<std::int64_t>(t.nbytes());
  }
  return bytes;
}

// A contiguous tensor's bytes, as a flat uint8 view of its memory (on its device).
inline torch::Tensor bytes_of(const torch::Tensor& t) {
  return t.reshape({-1}).view(torch::kUInt8);
}

// The header of `m`, whose tensors travel inline (`inlined`) or each on its own; `tails` gets the
// index of each tensor's tail word, left 0 here (transfers_of fills them).
inline std::vector<std::int64_t> encode_header(const Message& m, bool inlined,
                                               std::vector<std::size_t>* tails = nullptr) {
  std::vector<std::int64_t> h{header_mark(), 0, static_cast<std::int64_t>(m.tensors.size()),
                              (m.atomic ? kTupleFlag : 0) | (inlined ? kInlineFlag : 0),
                              first_bytes(inlined ? payload_bytes(m) : 0)};
  for (const auto& t : m.tensors) {
    h.push_back(t.defined() ? 1 : 0);
    if (!t.defined()) continue;
    h.push_back(static_cast<std::int64_t>(t.scalar_type()));
    h.push_back(t.dim());
    for (auto s : t.sizes()) h.push_back(s);
    if (inlined || t.numel() == 0) continue;
    h.push_back(static_cast<std::int64_t>(t.nbytes()));
    if (tails) tails->push_back(h.size());
    h.push_back(0);
  }
  h[1] = static_cast<std::int64_t>(h.size());
  return h;
}

// A CPU tensor's last (at most kTailBytes) bytes, as its header announces them.
inline std::int64_t tail_word(const torch::Tensor& cpu) {
  const auto n = std::min<std::int64_t>(kTailBytes, static_cast<std::int64_t>(cpu.nbytes()));
  std::int64_t word = 0;
  std::memcpy(&word, static_cast<const char*>(cpu.data_ptr()) + cpu.nbytes() - n,
              static_cast<std::size_t>(n));
  return word;
}

// The transfers that carry `m` to another rank, in the order they are sent under its tag, on
// `device` (copied there through copy_to, on the calling thread's streams). Where the header fits
// kFirstWords and the tensors fit `inline_room` (0: never), one transfer, inline. Else the first
// transfer (kBlockBytes: the header's first words and an end mark), the rest of the header if
// longer (with its end mark), and each non-empty tensor.
inline std::vector<torch::Tensor> transfers_of(const Message& m, const torch::Device& device,
                                               std::int64_t inline_room) {
  const std::int64_t bytes = payload_bytes(m);
  if (inline_room > 0 && bytes <= inline_room) {
    const auto words = encode_header(m, /*inlined=*/true);
    if (static_cast<std::int64_t>(words.size()) <= kFirstWords) {
      const std::int64_t total = first_bytes(bytes);
      auto first = torch::empty({total / 8}, torch::kInt64);
      auto* w = first.data_ptr<std::int64_t>();
      std::fill(std::copy(words.begin(), words.end(), w), w + kFirstWords, 0);
      auto* payload = reinterpret_cast<char*>(w + kFirstWords);
      for (const auto& t : m.tensors) {
        if (!t.defined() || t.numel() == 0) continue;
        const auto c = copy_to(t.detach(), torch::kCPU).contiguous();  // a GPU stage's, over Gloo
        std::memcpy(payload, c.data_ptr(), c.nbytes());
        payload += c.nbytes();
      }
      // Zeros, not whatever the allocator left, up to the end mark.
      std::memset(payload, 0,
                  static_cast<std::size_t>(reinterpret_cast<char*>(w + total / 8 - 1) - payload));
      w[total / 8 - 1] = end_mark(total);
      return {first};
    }
  }
  std::vector<torch::Tensor> tensors;
  for (const auto& t : m.tensors) {
    if (t.defined() && t.numel() > 0) tensors.push_back(copy_to(t.detach(), device).contiguous());
  }
  std::vector<std::size_t> tails;
  const auto words = encode_header(m, /*inlined=*/false, &tails);
  const auto n = static_cast<std::int64_t>(words.size());
  const std::int64_t rest = n > kFirstWords ? n - kFirstWords + 1 : 0;  // with its end mark
  // [first kFirstWords words, end mark, the other words, their end mark]: a word's place.
  const auto place = [](std::size_t i) {
    return static_cast<std::int64_t>(i) + (static_cast<std::int64_t>(i) < kFirstWords ? 0 : 1);
  };
  auto header = torch::zeros({kHeaderWords + rest}, torch::kInt64);
  auto* w = header.data_ptr<std::int64_t>();
  for (std::size_t i = 0; i < words.size(); ++i) w[place(i)] = words[i];
  w[kHeaderWords - 1] = end_mark(kBlockBytes);
  if (rest > 0) w[kHeaderWords + rest - 1] = end_mark(rest * 8);
  if (device.is_cpu()) {
    for (std::size_t k = 0; k < tails.size(); ++k) w[place(tails[k])] = tail_word(tensors[k]);
  }
  header = copy_to(header, device);
  if (!device.is_cpu()) {
    // The tails stay on the device: copied into the header there, on this thread's stream, which
    // the send waits for.
    const auto into = bytes_of(header);
    for (std::size_t k = 0; k < tails.size(); ++k) {
      const auto b = bytes_of(tensors[k]);
      const auto n_tail = std::min<std::int64_t>(kTailBytes, b.numel());
      into.narrow(0, place(tails[k]) * 8, n_tail).copy_(b.narrow(0, b.numel() - n_tail, n_tail));
    }
  }
  std::vector<torch::Tensor> out{header.narrow(0, 0, kHeaderWords)};
  if (rest > 0) out.push_back(header.narrow(0, kHeaderWords, rest));
  for (auto& t : tensors) out.push_back(std::move(t));
  return out;
}

// What a checked header says of one tensor.
struct TensorMeta {
  bool defined = false;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::vector<std::int64_t> sizes;
  std::int64_t bytes = 0;
  bool separate = false;  // travels on its own (not inline, not empty)
  std::int64_t tail = 0;  // its last bytes, when separate
};

// What a checked header says of its message.
struct Layout {
  bool atomic = false;
  bool inlined = false;
  std::vector<TensorMeta> tensors;
};

// "Float [4, 8]", as errors name a tensor.
inline std::string describe(const TensorMeta& t) {
  if (!t.defined) return "undefined";
  std::ostringstream out;
  out << c10::toString(t.dtype) << " " << c10::IntArrayRef(t.sizes);
  return out.str();
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

// Reads the header `h` (its words, end marks removed) and checks every word before anything is
// allocated: the tensor count, the flags, each defined flag, dtype, dimension count and size,
// each separate transfer's announced bytes against its shape, no words left over, the first
// transfer's announced length, and the message's bytes against `max_bytes`, or against
// `inline_room` (0 where nothing travels inline) for a message whose bytes follow the header. A
// bad one is an error naming the sender (`from()`, made only then).
template <class From>
Layout parse_header(const std::vector<std::int64_t>& h, std::int64_t max_bytes,
                    std::int64_t inline_room, const From& from) {
  const auto corrupt = [&](const std::string& why) {
    TORCH_CHECK(false, "stagewise: a message header from ", from(), " is corrupt: ", why,
                "; every rank must run the same stagewise version and pipe, and no other "
                "program may talk to this job's port");
  };
  const auto n = static_cast<std::int64_t>(h.size());
  if (n < kFixedWords || h[1] != n) corrupt("its length does not match its words");
  if (h[2] < 0 || h[2] > kMaxTensors) {
    corrupt("it claims " + std::to_string(h[2]) + " tensors (at most " +
            std::to_string(kMaxTensors) + ")");
  }
  if (h[3] < 0 || h[3] > (kTupleFlag | kInlineFlag)) {
    corrupt("its flags word is " + std::to_string(h[3]));
  }
  Layout out;
  out.atomic = (h[3] & kTupleFlag) != 0;
  out.inlined = (h[3] & kInlineFlag) != 0;
  const auto word = [&](std::int64_t at) { return h[static_cast<std::size_t>(at)]; };
  std::int64_t at = kFixedWords;
  double bytes = 0;  // in double: a corrupt size cannot overflow it past the check
  for (std::int64_t k = 0; k < h[2]; ++k) {
    const auto which = [k] { return "tensor " + std::to_string(k); };
    TensorMeta t;
    if (at >= n) corrupt(which() + " is cut off");
    const auto defined = word(at++);
    if (defined != 0 && defined != 1) {
      corrupt(which() + "'s defined flag is " + std::to_string(defined));
    }
    if (defined == 0) {
      out.tensors.push_back(t);
      continue;
    }
    t.defined = true;
    if (at + 2 > n) corrupt(which() + " is cut off");
    const auto dtype = word(at++);
    if (!sendable_dtype(dtype)) corrupt(which() + " has unknown dtype " + std::to_string(dtype));
    t.dtype = static_cast<c10::ScalarType>(dtype);
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
      t.sizes.push_back(size);
    }
    const double tensor_bytes = elements * static_cast<double>(c10::elementSize(t.dtype));
    bytes += tensor_bytes;
    if (tensor_bytes <= static_cast<double>(max_bytes)) {
      t.bytes = static_cast<std::int64_t>(tensor_bytes);
    }
    t.separate = !out.inlined && elements > 0;
    if (t.separate) {
      if (at + 2 > n) corrupt(which() + " is cut off");
      const auto announced = word(at++);
      t.tail = word(at++);
      // Refused before a receive is posted for it: Gloo would end this process on a transfer
      // longer than its receive.
      if (static_cast<double>(announced) != tensor_bytes) {
        corrupt(which() + " is announced as a transfer of " + std::to_string(announced) +
                " bytes, but " + describe(t) + " holds " +
                std::to_string(static_cast<std::int64_t>(tensor_bytes)) +
                " (refused before receiving it)");
      }
    }
    out.tensors.push_back(std::move(t));
  }
  if (at != n) corrupt("it has " + std::to_string(n - at) + " words beyond its tensors");
  if (out.inlined && (n > kFirstWords || bytes > static_cast<double>(inline_room))) {
    corrupt("it claims " + std::to_string(static_cast<std::int64_t>(bytes)) +
            " bytes inline, where a first transfer holds " + std::to_string(inline_room) +
            " after a header of at most " + std::to_string(kFirstWords) + " words");
  }
  const std::int64_t first = first_bytes(out.inlined ? static_cast<std::int64_t>(bytes) : 0);
  if (h[4] != first) {
    corrupt("it announces a first transfer of " + std::to_string(h[4]) + " bytes, where its " +
            (out.inlined ? "inline tensors make " : "header makes ") + std::to_string(first));
  }
  TORCH_CHECK(bytes <= static_cast<double>(max_bytes), "stagewise: a message from ", from(),
              " would need ", bytes, " bytes, above the limit of ", max_bytes,
              " bytes per message (C10dOptions::max_message_bytes): raise the limit if a stage "
              "really sends that much, else the sender is not a rank of this pipe");
  return out;
}

// The message a checked layout describes, with empty tensors of its dtypes and shapes on
// `device` (undefined where undefined).
inline Message allocate(const Layout& l, const torch::Device& device) {
  Message m;
  m.atomic = l.atomic;
  for (const auto& t : l.tensors) {
    if (!t.defined) {
      m.tensors.emplace_back();
      continue;
    }
    m.tensors.push_back(
        torch::empty(t.sizes, torch::TensorOptions().dtype(t.dtype).device(device)));
  }
  return m;
}

}  // namespace stagewise::runtime::detail
