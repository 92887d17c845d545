// The text of examples/gpt.cpp: every fortune of Debian's `fortunes` package as bytes, each
// document opened by byte 0; every tenth fortune held out for validation. Batches are windows of
// the byte stream at offsets drawn from a generator seeded by the step, so a resumed run draws
// the same batches without saving any sampler state.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace gpt {

/// Where the `fortunes` package puts its text.
inline constexpr const char* fortunes_dir = "/usr/share/games/fortunes";

/// The training and validation byte streams (int64 token ids, one dimension).
struct Corpus {
  torch::Tensor train, valid;
  int64_t documents = 0;
};

/// Splits a fortune file at its "%" lines.
inline std::vector<std::string> split_fortunes(const std::string& text) {
  std::vector<std::string> docs;
  std::istringstream in(text);
  std::string line, doc;
  while (std::getline(in, line)) {
    if (line == "%") {
      if (!doc.empty()) docs.push_back(std::move(doc));
      doc.clear();
    } else {
      doc += line + "\n";
    }
  }
  if (!doc.empty()) docs.push_back(std::move(doc));
  return docs;
}

/// Reads every fortune file under `dir` (the plain files; not the .dat indexes or .u8 links), in
/// name order, and holds out every tenth fortune.
inline Corpus load_corpus(const std::string& dir = fortunes_dir) {
  namespace fs = std::filesystem;
  TORCH_CHECK(fs::is_directory(dir), "gpt: no fortunes at ", dir,
              "; install Debian's `fortunes` package (apt-get install fortunes; ./bazelw does) "
              "or give --data=DIR with fortune files");
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    const auto ext = e.path().extension();
    if (e.is_regular_file() && !e.is_symlink() && ext != ".dat" && ext != ".u8") {
      files.push_back(e.path());
    }
  }
  std::sort(files.begin(), files.end());
  std::vector<int64_t> train, valid;
  Corpus corpus;
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    const std::string text{std::istreambuf_iterator<char>(in), {}};
    for (const auto& doc : split_fortunes(text)) {
      auto& out = corpus.documents++ % 10 == 9 ? valid : train;
      out.push_back(0);
      for (unsigned char ch : doc) out.push_back(ch == 0 ? ' ' : ch);
    }
  }
  TORCH_CHECK(!train.empty() && valid.size() > 1000, "gpt: ", dir,
              " holds too little text (", train.size() + valid.size(), " bytes)");
  corpus.train = torch::tensor(train, torch::kLong);
  corpus.valid = torch::tensor(valid, torch::kLong);
  return corpus;
}

/// `rows` windows of `context + 1` bytes from `stream` at `offsets`: inputs and next-byte targets.
inline std::pair<torch::Tensor, torch::Tensor> windows(const torch::Tensor& stream,
                                                       const torch::Tensor& offsets,
                                                       int64_t context) {
  auto index = offsets.unsqueeze(1) + torch::arange(context + 1, torch::kLong).unsqueeze(0);
  auto w = stream.index({index});
  return {w.narrow(1, 0, context).contiguous(), w.narrow(1, 1, context).contiguous()};
}

/// The training batch of `step`: random windows, drawn from a generator seeded by (seed, step).
inline std::pair<torch::Tensor, torch::Tensor> train_batch(const Corpus& c, int64_t step,
                                                           int64_t rows, int64_t context,
                                                           uint64_t seed = 1234) {
  auto gen = at::detail::createCPUGenerator(seed * 1000003 + static_cast<uint64_t>(step));
  auto offsets = torch::randint(c.train.size(0) - context - 1, {rows}, gen, torch::kLong);
  return windows(c.train, offsets, context);
}

/// The fixed validation batch: `rows` windows spread evenly over the held-out stream.
inline std::pair<torch::Tensor, torch::Tensor> valid_batch(const Corpus& c, int64_t rows,
                                                           int64_t context) {
  const int64_t span = c.valid.size(0) - context - 1;
  auto offsets = torch::arange(rows, torch::kLong) * (span / rows);
  return windows(c.valid, offsets, context);
}

}  // namespace gpt
