// Weights of examples/gpt.cpp for Python: the model's parameters and buffers under their module
// names ("embed.tok.weight", "block0.attn.qkv.weight", ...), written as a pickled dict that
// Python's torch.load reads (PyTorch's zip format, as torch::pickle_save writes it) and as safetensors
// (an 8-byte little-endian header length, a JSON header, then the raw bytes).
#pragma once

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/torch.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

namespace gpt {

/// Tensors by name, in name order (what both files hold).
using NamedTensors = std::map<std::string, torch::Tensor>;

/// A module's parameters and buffers by name, on the CPU; `drop_prefix` names a leading
/// component to remove ("stage1.embed.tok.weight" -> "embed.tok.weight" for a pipe's "stage<j>").
inline NamedTensors named_tensors(const torch::nn::Module& m, bool drop_prefix = false) {
  NamedTensors out;
  auto add = [&](const std::string& name, const torch::Tensor& t) {
    const auto dot = name.find('.');
    out[drop_prefix && dot != std::string::npos ? name.substr(dot + 1) : name] =
        t.detach().cpu().contiguous();
  };
  for (const auto& p : m.named_parameters(true)) add(p.key(), p.value());
  for (const auto& b : m.named_buffers(true)) add(b.key(), b.value());
  return out;
}

inline void write_bytes(const std::string& path, const char* data, std::size_t size) {
  std::ofstream out(path, std::ios::binary);
  TORCH_CHECK(out, "gpt: cannot write '", path, "'; give an --out directory that is writable");
  out.write(data, static_cast<std::streamsize>(size));
  TORCH_CHECK(out, "gpt: writing '", path, "' failed (disk full?)");
}

inline std::vector<char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, "gpt: cannot read '", path, "'");
  return {std::istreambuf_iterator<char>(in), {}};
}

/// `value` in the zip format of Python's `torch.save`, as `torch::pickle_save` writes it but
/// without TorchScript's type tags on dicts and lists, which PyTorch 2.6's default
/// `torch.load(path)` (weights_only=True) refuses ("Unsupported global: restore_type_tag").
inline std::vector<char> torch_save_bytes(const c10::IValue& value) {
  std::vector<char> pickle;
  torch::jit::Pickler pickler([&](const char* b, std::size_t n) { pickle.insert(pickle.end(), b, b + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr,
                              /*memoized_class_types=*/nullptr, /*get_tensor_id=*/nullptr,
                              /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::vector<char> out;
  {  // the writer finishes the zip when it goes out of scope
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* b, std::size_t n) {
      out.insert(out.end(), static_cast<const char*>(b), static_cast<const char*>(b) + n);
      return n;
    });
    torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(),
                                       writer);
  }
  return out;
}

/// The tensors as a pickled dict of str -> Tensor (Python: `torch.load(path)`).
inline std::vector<char> to_pickle(const NamedTensors& tensors) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, t] : tensors) dict.insert(name, t);
  return torch_save_bytes(c10::IValue(dict));
}

/// Reads back what `to_pickle` wrote (also a part file of a distributed run).
inline NamedTensors from_pickle(const std::vector<char>& bytes) {
  NamedTensors out;
  for (const auto& e : torch::pickle_load(bytes).toGenericDict()) {
    out[e.key().toStringRef()] = e.value().toTensor();
  }
  return out;
}

inline const char* safetensors_dtype(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat: return "F32";
    case torch::kDouble: return "F64";
    case torch::kHalf: return "F16";
    case torch::kBFloat16: return "BF16";
    case torch::kLong: return "I64";
    case torch::kInt: return "I32";
    case torch::kBool: return "BOOL";
    case torch::kByte: return "U8";
    default: TORCH_CHECK(false, "gpt: safetensors has no dtype for ", t);
  }
}

/// The tensors in the safetensors format (Python: `safetensors.torch.load_file(path)`).
inline std::string to_safetensors(const NamedTensors& tensors) {
  std::string header = "{";
  std::string data;
  for (const auto& [name, t] : tensors) {
    const auto begin = data.size();
    data.append(static_cast<const char*>(t.data_ptr()), t.nbytes());
    header += (header.size() > 1 ? ",\"" : "\"") + name + "\":{\"dtype\":\"" +
              safetensors_dtype(t.scalar_type()) + "\",\"shape\":[";
    for (int64_t d = 0; d < t.dim(); ++d) header += (d ? "," : "") + std::to_string(t.size(d));
    header += "],\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(data.size()) + "]}";
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((uint64_t(header.size()) >> (8 * i)) & 0xff);
  return out + header + data;
}

/// Writes `<stem>.pt` and `<stem>.safetensors`.
inline void export_weights(const NamedTensors& tensors, const std::string& stem) {
  const auto pt = to_pickle(tensors);
  write_bytes(stem + ".pt", pt.data(), pt.size());
  const auto st = to_safetensors(tensors);
  write_bytes(stem + ".safetensors", st.data(), st.size());
}

}  // namespace gpt
