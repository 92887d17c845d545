#pragma once

// FileStore's optimizer state: one file per key, `<dir>/<owner.>state.<key>`, holding the state's
// tensors back to back (their shapes, types and the step count are kept in memory). A step's new
// state is written to `<file>.next` and renamed over the file on commit; a discard removes the
// `.next` files, so a failed step leaves every kept state as it was. The files are scratch,
// removed with the store.

#include "stagewise/optim/state_offload.hpp"
#include "stagewise/runtime/detail/file_tensor.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime::detail {

// `who` (each call's) names the store in errors.
class StateFiles {
 public:
  StateFiles() = default;
  StateFiles(const StateFiles&) = delete;
  StateFiles& operator=(const StateFiles&) = delete;
  ~StateFiles() {
    for (const auto& [key, f] : files_) {
      if (f.kept) ::unlink(f.path.c_str());
      if (f.staged) ::unlink(next_of(f.path).c_str());
    }
  }

  bool any() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return !files_.empty();
  }

  std::optional<optim::StateRecord> read(const std::string& who, const std::string& key) {
    Layout layout;
    std::string path;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = files_.find(key);
      if (it == files_.end() || !it->second.kept) return std::nullopt;
      layout = *it->second.kept;
      path = it->second.path;
    }
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TORCH_CHECK(fd >= 0, "stagewise::", who, ": cannot open '", path, "', the optimizer state of '",
                key, "' (", std::strerror(errno),
                "); was it removed during training? Keep the directory for the store alone");
    optim::StateRecord out;
    out.step = layout.step;
    try {
      for (const auto& t : layout.tensors) {
        if (!t.defined) {
          out.tensors.emplace_back();
          continue;
        }
        auto host = t.empty_host();
        transfer(who, path, key, t.bytes, "reading", "from", "end of file",
                 "was the file changed during training? Keep the directory for the store alone",
                 [&](std::int64_t done) {
                   return ::pread(fd, static_cast<char*>(host.data_ptr()) + done,
                                  static_cast<std::size_t>(t.bytes - done),
                                  static_cast<off_t>(t.offset + done));
                 });
        out.tensors.push_back(std::move(host));
      }
    } catch (...) {
      ::close(fd);
      throw;
    }
    ::close(fd);
    return out;
  }

  // Stages `record` for `key`, whose file is `path` (on its first write).
  void write(const std::string& who, const std::string& key, const std::string& path_if_new,
             const optim::StateRecord& record) {
    const std::string path = claim(who, key, path_if_new);
    const std::string next = next_of(path);
    Layout layout;
    layout.step = record.step;
    if (!record.empty()) {
      const int fd = ::open(next.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      TORCH_CHECK(fd >= 0 || errno != EEXIST, "stagewise::", who, ": '", next,
                  "' exists: another FileStore (another optimizer, or another job on this "
                  "machine) keeps optimizer state in this directory, or a run that crashed left "
                  "it; give each a directory of its own, or remove the file");
      TORCH_CHECK(fd >= 0, "stagewise::", who, ": cannot create '", next,
                  "' for the optimizer state of '", key, "' (", std::strerror(errno),
                  "); make the directory writable, or give FileStore one that is");
      try {
        std::int64_t end = 0;
        for (const auto& t : record.tensors) {
          Tensor meta;
          if (t.defined()) {
            const auto host = t.detach().to(torch::kCPU).contiguous();
            meta = {true, host.sizes().vec(), host.scalar_type(), end,
                    static_cast<std::int64_t>(host.nbytes())};
            transfer(who, next, key, meta.bytes, "writing", "to", "disk full",
                     "free space on that disk or give FileStore a directory on one with room",
                     [&](std::int64_t done) {
                       return ::pwrite(fd, static_cast<const char*>(host.data_ptr()) + done,
                                       static_cast<std::size_t>(meta.bytes - done),
                                       static_cast<off_t>(meta.offset + done));
                     });
            end += meta.bytes;
          }
          layout.tensors.push_back(std::move(meta));
        }
      } catch (...) {
        ::close(fd);
        ::unlink(next.c_str());
        throw;
      }
      ::close(fd);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    files_.at(key).staged = std::move(layout);
  }

  // Every staged state becomes the kept one: its file renamed over the old (an empty record's
  // old file removed).
  void commit(const std::string& who) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [key, f] : files_) {
      if (!f.staged) continue;
      if (f.staged->tensors.empty()) {
        if (f.kept) ::unlink(f.path.c_str());
        f.kept.reset();
      } else {
        TORCH_CHECK(::rename(next_of(f.path).c_str(), f.path.c_str()) == 0, "stagewise::", who,
                    ": cannot rename '", next_of(f.path), "' to '", f.path, "' (",
                    std::strerror(errno),
                    "): the optimizer state in the store is now partly of this step; resume from "
                    "the last save (pipe->load)");
        f.kept = std::move(f.staged);
      }
      f.staged.reset();
    }
  }

  // Every staged state is dropped (its file removed); the kept ones stay.
  void discard() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [key, f] : files_) {
      if (f.staged && !f.staged->tensors.empty()) ::unlink(next_of(f.path).c_str());
      f.staged.reset();
    }
  }

 private:
  using Tensor = FileTensor;
  struct Layout {
    std::vector<Tensor> tensors;
    std::int64_t step = 0;
  };
  struct File {
    std::string path;
    std::optional<Layout> kept, staged;
  };

  static std::string next_of(const std::string& path) { return path + ".next"; }

  // The file of `key`; on its first use, checks that no other store's file is there.
  std::string claim(const std::string& who, const std::string& key, const std::string& path) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = files_.find(key);
    if (it != files_.end()) return it->second.path;
    struct stat st {};
    TORCH_CHECK(::stat(path.c_str(), &st) != 0, "stagewise::", who, ": '", path,
                "' exists: another FileStore (another optimizer, or another job on this machine) "
                "keeps optimizer state in this directory, or a run that crashed left it; give "
                "each a directory of its own, or remove the file");
    files_[key].path = path;
    return path;
  }

  // Runs `step(done)` (one pread or pwrite from `done` bytes on) until `bytes` are through; a
  // failure names the store, the key, the file, the bytes and the fix.
  template <class Step>
  static void transfer(const std::string& who, const std::string& path, const std::string& key,
                       std::int64_t bytes, const char* doing, const char* preposition,
                       const char* short_reason, const char* fix, Step&& step) {
    std::int64_t done = 0;
    while (done < bytes) {
      const auto n = step(done);
      if (n < 0 && errno == EINTR) continue;
      TORCH_CHECK(n > 0, "stagewise::", who, ": ", doing, " ", bytes,
                  " bytes of the optimizer state of '", key, "' ", preposition, " '", path,
                  "' failed after ", done, " (", n < 0 ? std::strerror(errno) : short_reason, "); ",
                  fix);
      done += n;
    }
  }

  mutable std::mutex mutex_;
  std::map<std::string, File> files_;
};

}  // namespace stagewise::runtime::detail
