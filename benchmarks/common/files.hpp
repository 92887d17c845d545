#pragma once

// Small file-system helpers over POSIX calls, for the benchmark commons and their tests, in place
// of std::filesystem. Python's torch wheel exports its own copy of std::filesystem from
// libtorch.so / libtorch_cpu.so: a program linked against it had its std::filesystem::remove_all
// call bind to that copy and jump to address 0. Code here that LibTorch is linked into uses
// these instead (libc only). Paths are plain strings; nothing throws.

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace stagewise::bench::files {

/// `dir` and `name` joined by one slash ("a" + "b" = "a/b", "a/" + "b" = "a/b").
inline std::string join(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

/// The last component of `path` ("a/b/c.py" gives "c.py").
inline std::string filename(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

/// Everything before the last component ("a/b/c.py" gives "a/b", "c.py" gives ".").
inline std::string parent(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

/// Whether `path` names something (following symlinks).
inline bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

/// Whether `path` is a directory (following symlinks).
inline bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

/// Whether `path` itself is a symbolic link.
inline bool is_symlink(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

/// The names in directory `dir`, without "." and ".."; empty when it cannot be read.
inline std::vector<std::string> list(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  return names;
}

/// Creates `path` and its missing parents (mkdir -p); true when it is a directory afterwards.
inline bool make_directories(const std::string& path) {
  for (std::size_t i = 1; i <= path.size(); ++i) {
    if (i == path.size() || path[i] == '/') {
      const std::string prefix = path.substr(0, i);
      if (::mkdir(prefix.c_str(), 0777) != 0 && errno != EEXIST) return false;
    }
  }
  return is_directory(path);
}

/// Removes `path` and, for a directory, everything below it (rm -rf; symlinks are removed, not
/// followed). True when nothing is left, also when there was nothing to remove.
inline bool remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return errno == ENOENT;
  const auto remove_one = [](const char* p, const struct stat*, int, FTW*) {
    return std::remove(p) == 0 ? 0 : -1;
  };
  return ::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) == 0;
}

/// Copies the regular file `from` to `to`, replacing it; with `only_if_newer`, an existing `to`
/// at least as new as `from` is left as it is. True on success.
inline bool copy_file(const std::string& from, const std::string& to, bool only_if_newer = false) {
  struct stat src {};
  if (::stat(from.c_str(), &src) != 0) return false;
  if (only_if_newer) {
    struct stat dst {};
    if (::stat(to.c_str(), &dst) == 0 && dst.st_mtime >= src.st_mtime) return true;
  }
  const int in = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) return false;
  const int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, src.st_mode & 0777);
  if (out < 0) {
    ::close(in);
    return false;
  }
  bool ok = true;
  char buffer[1 << 16];
  for (;;) {
    const ssize_t n = ::read(in, buffer, sizeof buffer);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      ok = false;
      break;
    }
    for (ssize_t done = 0; done < n;) {
      const ssize_t w = ::write(out, buffer + done, static_cast<std::size_t>(n - done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        ok = false;
        break;
      }
      done += w;
    }
    if (!ok) break;
  }
  ::close(in);
  return ::close(out) == 0 && ok;
}

/// Makes `to` a symbolic link with the same target as the link `from`. True on success.
inline bool copy_symlink(const std::string& from, const std::string& to) {
  std::string target(4096, '\0');
  const ssize_t n = ::readlink(from.c_str(), target.data(), target.size());
  if (n < 0 || static_cast<std::size_t>(n) >= target.size()) return false;
  target.resize(static_cast<std::size_t>(n));
  return ::symlink(target.c_str(), to.c_str()) == 0;
}

/// The directory for temporary files: $TMPDIR, else /tmp.
inline std::string temp_directory() {
  const char* dir = std::getenv("TMPDIR");
  return dir != nullptr && *dir != '\0' ? dir : "/tmp";
}

}  // namespace stagewise::bench::files
