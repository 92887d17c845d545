#!/usr/bin/env python3
"""Compile-only checks over LibTorch's headers parsed once (a GCC precompiled header).

  syntax_check.py pch OUT_DIR HEADER...          write OUT_DIR/torch_prefix.hpp and its .gch
  syntax_check.py headers [--pch HPP] HEADER...  each public header compiles alone, included twice
  syntax_check.py sources [--pch HPP] SRC...     each source (a benchmark) compiles

Run from the repository root (a Bazel runfiles or execution root). A LibTorch translation unit
spends most of its time parsing LibTorch: the checks share one precompiled prefix of the LibTorch
headers the library itself includes (read from the headers; c10d's and CUDA's left out, as they
need defines), so each check parses only stagewise's code. A file whose includes reach no LibTorch
header beyond c10/util compiles without the prefix (loading it costs more than such a file).

What a check asserts: the file compiles with -std=c++20 -Wall -Wextra -Werror after at most that
prefix, i.e. it includes every stagewise and standard header it needs (LibTorch's own headers are
LibTorch's to keep self-contained). -Winvalid-pch makes a prefix GCC would not use an error.
Under Bazel's test sharding each shard checks every N-th file.
The compiler is $CXX (default g++); LibTorch's C++ API include directory is
$STAGEWISE_TORCH_API_INCLUDE (default /usr/include/torch/csrc/api/include), as in compile_fail.sh.
"""

import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import time

CXX = os.environ.get("CXX", "g++")
TORCH_API = os.environ.get("STAGEWISE_TORCH_API_INCLUDE", "/usr/include/torch/csrc/api/include")
FLAGS = ["-std=c++20", "-Wall", "-Wextra", "-Werror", "-Iinclude", "-I.", "-isystem", TORCH_API]
LIBTORCH = re.compile(r'^\s*#\s*include\s*<((?:torch|ATen|c10|caffe2)/[^>]+)>', re.M)
OURS = re.compile(r'^\s*#\s*include\s*(?:"([^"]+)"|<(stagewise/[^>]+)>)', re.M)


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def prefix_headers(headers):
    """LibTorch headers the library includes, for the prefix: not c10d's or CUDA's."""
    seen = []
    for h in headers:
        for inc in LIBTORCH.findall(read(h)):
            if "distributed/c10d" in inc or "cuda" in inc.lower() or inc in seen:
                continue
            seen.append(inc)
    return sorted(seen)


def closure(path, cache={}):
    """Every file `path` includes, transitively, through quoted includes that exist here."""
    if path in cache:
        return cache[path]
    cache[path] = set()
    found = set()
    text = read(path)
    found.update("<" + inc for inc in LIBTORCH.findall(text))
    for quoted, angled in OURS.findall(text):
        inc = quoted or angled
        for root in ("include", "."):
            candidate = os.path.join(root, inc)
            if os.path.exists(candidate):
                found.add(candidate)
                found |= closure(candidate)
                break
    cache[path] = found
    return found


def heavy(path):
    """Whether the file reaches a LibTorch header beyond c10's utilities (then the prefix pays)."""
    return any(f.startswith("<") and not f.startswith("<c10/") for f in closure(path))


def defines(path):
    # The distributed headers compile with Gloo's backend, as //:distributed builds them.
    return ["-DUSE_C10D_GLOO"] if any("distributed/c10d" in f for f in closure(path)) else []


def compile_one(source_text, path, pch):
    cmd = [CXX] + FLAGS + ["-fsyntax-only"] + defines(path)
    if pch and heavy(path):
        cmd += ["-Winvalid-pch", "-include", pch]
    start = time.monotonic()
    with tempfile.NamedTemporaryFile("w", suffix=".cpp", dir=os.environ.get("TEST_TMPDIR")) as tu:
        tu.write(source_text)
        tu.flush()
        result = subprocess.run(cmd + [tu.name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return path, result.returncode, result.stdout, time.monotonic() - start


def shard(paths):
    """Bazel's test sharding (shard_count): every N-th file, one compiler at a time (Bazel runs
    the shards side by side); unsharded, every file, a compiler per core."""
    total, index = os.environ.get("TEST_TOTAL_SHARDS"), os.environ.get("TEST_SHARD_INDEX")
    if total is None or index is None:
        return paths, os.cpu_count() or 2
    status = os.environ.get("TEST_SHARD_STATUS_FILE")
    if status:
        open(status, "w").close()
    return paths[int(index)::int(total)], 1


def run_checks(kind, paths, pch):
    paths, workers = shard(paths)
    jobs = []
    for p in paths:
        if kind == "headers":
            include = p[len("include/"):] if p.startswith("include/") else p
            text = '#include "%s"\n#include "%s"\n' % (include, include)
        else:
            text = '#include "%s"\n' % p
        jobs.append((text, p))
    for p in paths:  # the include closures, before the threads share them
        closure(p)
    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for path, rc, out, secs in pool.map(lambda j: compile_one(j[0], j[1], pch), jobs):
            if rc != 0:
                failed.append(path)
                print("FAILED %s: it does not compile on its own:\n%s" % (path, out[:20000]))
            else:
                print("ok %5.1f s %s" % (secs, path))
    print("%d passed, %d failed" % (len(paths) - len(failed), len(failed)))
    return 1 if failed else 0


def make_pch(out_dir, headers):
    os.makedirs(out_dir, exist_ok=True)
    hpp = os.path.join(out_dir, "torch_prefix.hpp")
    with open(hpp, "w", encoding="utf-8") as f:
        f.write("// LibTorch's headers that stagewise includes, precompiled once (tools/bazel/"
                "syntax_check.py)\n")
        for inc in prefix_headers(headers):
            f.write("#include <%s>\n" % inc)
    cmd = [CXX] + FLAGS + ["-x", "c++-header", hpp, "-o", hpp + ".gch"]
    return subprocess.call(cmd)


def main(argv):
    if len(argv) < 3 or argv[1] not in ("pch", "headers", "sources"):
        print(__doc__)
        return 2
    if argv[1] == "pch":
        return make_pch(argv[2], argv[3:])
    args = argv[2:]
    pch = None
    if args[:1] == ["--pch"]:
        pch = os.path.abspath(args[1])
        args = args[2:]
    return run_checks(argv[1], args, pch)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
