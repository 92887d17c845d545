#pragma once

#include "stagewise/runtime/message.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace stagewise::runtime::detail {

// The metadata of a message, sent ahead of its tensors so that the receiver allocates them
// without being told shapes in advance: [magic, words, tensors, atomic, then per tensor: defined,
// dtype, ndim, sizes...]. The first kHeaderWords words always travel (one fixed-size receive);
// a longer header continues in a second message of words - kHeaderWords words.
inline constexpr std::int64_t kHeaderMagic = 0x5377486472;  // "SwHdr"
inline constexpr std::int64_t kHeaderWords = 64;

inline std::vector<std::int64_t> encode_header(const Message& m) {
  std::vector<std::int64_t> h{kHeaderMagic, 0, static_cast<std::int64_t>(m.tensors.size()),
                              m.atomic ? 1 : 0};
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

// Words still to receive after the fixed-size part, from its second word.
inline std::int64_t header_rest(const torch::Tensor& fixed) {
  const auto* w = fixed.data_ptr<std::int64_t>();
  TORCH_CHECK(w[0] == kHeaderMagic,
              "stagewise: a message header from another rank is garbled; every rank must run the "
              "same stagewise version and pipe");
  return w[1] > kHeaderWords ? w[1] - kHeaderWords : 0;
}

// The message with empty tensors of the right dtypes and shapes (undefined where undefined).
inline Message decode_header(const std::vector<std::int64_t>& h, const torch::Device& device) {
  Message m;
  m.atomic = h[3] != 0;
  std::size_t at = 4;
  for (std::int64_t k = 0; k < h[2]; ++k) {
    if (h[at++] == 0) {
      m.tensors.emplace_back();
      continue;
    }
    const auto dtype = static_cast<c10::ScalarType>(h[at++]);
    const auto ndim = static_cast<std::size_t>(h[at++]);
    std::vector<std::int64_t> sizes(h.begin() + static_cast<std::ptrdiff_t>(at),
                                    h.begin() + static_cast<std::ptrdiff_t>(at + ndim));
    at += ndim;
    m.tensors.push_back(torch::empty(sizes, torch::TensorOptions().dtype(dtype).device(device)));
  }
  return m;
}

}  // namespace stagewise::runtime::detail
