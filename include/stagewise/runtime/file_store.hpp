#pragma once

#include "stagewise/optim/state_offload.hpp"
#include "stagewise/runtime/detail/file_tensor.hpp"
#include "stagewise/runtime/detail/state_files.hpp"
#include "stagewise/runtime/offload_store.hpp"
#include "stagewise/runtime/state_store.hpp"
#include "stagewise/runtime/stream.hpp"

#include <c10/util/Exception.h>
#include <torch/types.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace stagewise::runtime {

/// An offload store in files: one file per stage, `<dir>/stage<j>.offload`, in a directory the
/// user names (a local NVMe disk, say). Offloading writes a cell's kept tensors to its stage's file
/// and drops them from memory; reloading reads them back onto the stage's device. A stage's file
/// is reused from its start whenever every tensor in it has been reloaded (each step, at the
/// latest), so it never holds more than one step's offloads; it is removed with the store. In a
/// `distributed::Pipe` the files are named after the rank, `<dir>/rank<r>.stage<j>.offload`
/// (`set_owner`), so all the ranks of a job on one machine (data-parallel replicas run the same
/// stage in several processes) may share one directory. A missing or unwritable directory, or a
/// stage file already there (another store's: another pipe or job over the same directory, or a
/// crashed run's), fails the step before anything runs; a failed write (disk full) fails it at the
/// offload; each error names the store and the fix. The directory is not created: name one that
/// exists.
/// It keeps optimizer state too (`state_store`, for `OffloadedState`: state larger than host
/// memory): one file per parameter, `<dir>/<owner.>state.<key>`; a step's new state goes to
/// `<file>.next`, renamed over the file only when every parameter's step succeeded, so a write
/// that fails (a full disk) names the file and leaves every kept state as it was.
///   auto options = sw::PipeOptions().chunks(8).offload(sw::runtime::FileStore("/nvme/offload"));
class FileStore {
 public:
  explicit FileStore(std::string dir)
      : dir_(std::move(dir)), state_(std::make_unique<detail::StateFiles>()) {
    TORCH_CHECK(!dir_.empty(),
                "stagewise::FileStore: the directory is empty; name the directory to write "
                "offloaded activations to (e.g. FileStore(\"/nvme/offload\"))");
  }

  /// Opens (or reopens) the files of `stages`, each from its start.
  void begin_step(const std::vector<int>& stages) {
    for (int j : stages) {
      if (static_cast<std::size_t>(j) >= files_.size())
        files_.resize(static_cast<std::size_t>(j) + 1);
      auto& f = files_[static_cast<std::size_t>(j)];
      if (!f) f = std::make_unique<StageFile>();
      f->records.clear();  // what a failed step left
      f->end = 0;
      if (f->fd >= 0) continue;
      const std::string path = path_of(j);
      // Created here, never shared: two stores writing one file (two processes of a job on one
      // machine, two pipes) would read each other's bytes.
      f->fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      TORCH_CHECK(f->fd >= 0 || errno != EEXIST, "stagewise::", describe(), ": '", path,
                  "' exists: another FileStore (another pipe, or another job on this machine) "
                  "offloads stage ",
                  j,
                  " to this directory, or a run that crashed left it; give each pipe's store a "
                  "directory of its own, or remove the file");
      TORCH_CHECK(f->fd >= 0, "stagewise::", describe(), ": cannot open '", path, "' for stage ", j,
                  "'s offloaded activations (", std::strerror(errno), "); create the directory '",
                  dir_,
                  "' and make it writable, or give FileStore a directory that is (e.g. on a "
                  "local NVMe disk)");
      f->path = path;
    }
  }

  /// Writes `tensors` (moved to the CPU first, if they are not there) to `key`'s stage file.
  void put(const StoreKey& key, std::vector<torch::Tensor> tensors) {
    StageFile& f = file(key, "offloads");
    std::vector<Record> records;
    for (auto& t : tensors) {
      Record r;
      if (t.defined()) {
        torch::Tensor host = copy_to(t.detach(), torch::kCPU).contiguous();
        r.defined = true;
        r.sizes = host.sizes().vec();
        r.dtype = host.scalar_type();
        r.offset = f.end;
        r.bytes = static_cast<std::int64_t>(host.nbytes());
        write_all(f, key, static_cast<const char*>(host.data_ptr()), r.bytes, r.offset);
        f.end += r.bytes;
      }
      t = torch::Tensor();
      records.push_back(std::move(r));
    }
    f.records[key.micro] = std::move(records);
  }

  /// Reads `key`'s tensors back onto `device`.
  std::vector<torch::Tensor> take(const StoreKey& key, const torch::Device& device) {
    StageFile& f = file(key, "reloads");
    auto it = f.records.find(key.micro);
    TORCH_CHECK(it != f.records.end(), "stagewise::", describe(), ": stage ", key.stage,
                " reloads micro-batch ", key.micro,
                ", which it never offloaded; verify the plan (schedule::verify)");
    std::vector<torch::Tensor> out;
    for (const auto& r : it->second) {
      if (!r.defined) {
        out.emplace_back();
        continue;
      }
      torch::Tensor host = r.empty_host();
      read_all(f, key, static_cast<char*>(host.data_ptr()), r.bytes, r.offset);
      out.push_back(copy_to(host, device));
    }
    f.records.erase(it);
    if (f.records.empty()) f.end = 0;  // nothing left in the file: reuse it from its start
    return out;
  }

  /// Names the files after `owner`, the process of a job that uses the store:
  /// `<dir>/<owner>.stage<j>.offload`. `distributed::Pipe` sets "rank<r>" (the job's rank), so
  /// that the processes of a job that run the same stage (data-parallel replicas) never write one
  /// file. Once; setting another owner later (one store given to pipes of two ranks) is refused.
  void set_owner(const std::string& owner) {
    TORCH_CHECK(!owner.empty() && owner.find('/') == std::string::npos, "stagewise::", describe(),
                ": the owner '", owner,
                "' cannot name a file; give a non-empty name without '/' (e.g. \"rank0\")");
    if (owner == owner_) return;
    bool open = state_->any();
    for (const auto& f : files_) open = open || (f && f->fd >= 0);
    TORCH_CHECK(
        owner_.empty() && !open, "stagewise::", describe(), ": the store's files are ",
        owner_.empty() ? std::string("open (a pipe used it)") : "named for '" + owner_ + "'",
        " and now a pipe names them for '", owner,
        "': one FileStore given to two pipes would mix their bytes; give each pipe a "
        "FileStore of its own");
    owner_ = owner;
  }

  std::string describe() const { return "FileStore('" + dir_ + "')"; }

  /// The optimizer state kept for `key`, read from its file (none: not yet).
  std::optional<optim::StateRecord> read_state(const std::string& key) {
    return state_->read(describe(), key);
  }
  /// Writes `record` to `key`'s file's `.next`, staged until commit_state.
  void write_state(const std::string& key, optim::StateRecord record) {
    state_->write(describe(), key, state_path_of(key), record);
  }
  /// Renames every staged state's file over the kept one.
  void commit_state() { state_->commit(describe()); }
  /// Removes every staged state's file; the kept ones stay.
  void discard_state() { state_->discard(); }
  /// The file of the optimizer state kept for `key`.
  std::string state_path_of(const std::string& key) const {
    return dir_ + "/" + (owner_.empty() ? "" : owner_ + ".") + "state." + key;
  }
  /// The file of stage `j`.
  std::string path_of(int j) const {
    return dir_ + "/" + (owner_.empty() ? "" : owner_ + ".") + "stage" + std::to_string(j) +
           ".offload";
  }

 private:
  using Record = detail::FileTensor;
  struct StageFile {
    StageFile() = default;
    StageFile(const StageFile&) = delete;
    StageFile& operator=(const StageFile&) = delete;
    ~StageFile() {
      if (fd < 0) return;
      ::close(fd);
      ::unlink(path.c_str());  // scratch: removed with its store
    }
    int fd = -1;
    std::string path;
    std::int64_t end = 0;                        // where the next tensor goes
    std::map<int, std::vector<Record>> records;  // per micro-batch; touched by the stage's worker
  };

  StageFile& file(const StoreKey& key, const char* what) {
    const auto j = static_cast<std::size_t>(key.stage);
    TORCH_CHECK(j < files_.size() && files_[j] && files_[j]->fd >= 0, "stagewise::", describe(),
                ": stage ", key.stage, " ", what,
                " before the store was opened for it; call begin_step with the stages that "
                "offload (train_step does)");
    return *files_[j];
  }

  void write_all(StageFile& f, const StoreKey& key, const char* data, std::int64_t bytes,
                 std::int64_t offset) {
    transfer(key, bytes, "writing", "to", "disk full",
             "free space on that disk or give FileStore a directory on one with room",
             [&](std::int64_t done) {
               return ::pwrite(f.fd, data + done, static_cast<std::size_t>(bytes - done),
                               static_cast<off_t>(offset + done));
             });
  }

  void read_all(StageFile& f, const StoreKey& key, char* data, std::int64_t bytes,
                std::int64_t offset) {
    transfer(key, bytes, "reading", "from", "end of file",
             "was the file changed or removed during the step? Keep the directory for the "
             "store alone",
             [&](std::int64_t done) {
               return ::pread(f.fd, data + done, static_cast<std::size_t>(bytes - done),
                              static_cast<off_t>(offset + done));
             });
  }

  // Runs `step(done)` (one pread or pwrite from `done` bytes on) until `bytes` are through; a
  // failure names the store, the cell, the file, the bytes and the fix.
  template <class Step>
  void transfer(const StoreKey& key, std::int64_t bytes, const char* doing, const char* preposition,
                const char* short_reason, const char* fix, Step&& step) {
    std::int64_t done = 0;
    while (done < bytes) {
      const auto n = step(done);
      if (n < 0 && errno == EINTR) continue;
      TORCH_CHECK(n > 0, "stagewise::", describe(), ": ", doing, " ", bytes, " bytes of stage ",
                  key.stage, "'s micro-batch ", key.micro, " ", preposition, " '",
                  path_of(key.stage), "' failed after ", done, " (",
                  n < 0 ? std::strerror(errno) : short_reason, "); ", fix);
      done += n;
    }
  }

  std::string dir_;
  std::string owner_;  // names the files (set_owner); empty: "stage<j>.offload"
  std::vector<std::unique_ptr<StageFile>> files_;  // per stage; resized only in begin_step
  std::unique_ptr<detail::StateFiles> state_;      // optimizer state, per key
};

static_assert(offload_store<FileStore>);
static_assert(state_store<FileStore>);

}  // namespace stagewise::runtime
