#!/usr/bin/env bash
# Compile-only check of stagewise's CUDA code paths on a machine without a GPU; see --help.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tools/cuda_compile_check.sh [--cuda DIR] [--torch PREFIX] [--jobs N]

Compiles stagewise's GPU code paths with CUDA enabled, for syntax and types only (g++
-fsyntax-only, C++20, -Wall -Wextra -Werror; nothing is linked or run), so they cannot rot while
no GPU is at hand. Each of these is one case:
  - every public header (include/stagewise/**/*.hpp) in one translation unit, with USE_CUDA
    defined, so `#if defined(USE_CUDA)` branches are compiled too (and STAGEWISE_WITH_CUDA, the
    CUDA branch of balance_by_size, and USE_C10D_GLOO, which the
    distributed headers need, as //:distributed defines it; and USE_C10D_NCCL, the NCCL
    process groups, where the toolkit has nccl.h);
  - tests/cuda/cuda_paths.cpp: the device-generic streams, RNG snapshots and a two-GPU Pipe
    driven with CUDA's own types (c10::cuda::CUDAStream, CUDAGuard, at::cuda::CUDAEvent, the
    CUDA generator);
  - every tests/**/*_cuda_test.cpp;
  - benchmarks/pipe_cuda.cpp, the GPU benchmark (CUDA caching-allocator statistics, device
    properties), which only a CUDA LibTorch builds.
Works against Debian's CPU LibTorch, which ships the c10/cuda and ATen/cuda headers (the
generated cuda_cmake_macros.h it lacks is skipped), or an official CUDA LibTorch archive.

Options:
  --cuda DIR      the CUDA toolkit (default $CUDA_HOME, else /usr/local/cuda)
  --torch PREFIX  LibTorch's prefix, holding include/ (default /usr: Debian's libtorch-dev)
  --jobs N        compilers run at once (default: the number of cores)
  -h, --help      this text

Prints one line per case and closes with `N passed, N failed`; exits non-zero on a failure.
Example: tools/cuda_compile_check.sh --torch /opt/libtorch
EOF
}

cuda=${CUDA_HOME:-/usr/local/cuda}
torch=/usr
jobs=$(nproc)
while (($#)); do
  case $1 in
    --cuda) cuda=$2; shift ;;
    --torch) torch=$2; shift ;;
    --jobs) jobs=$2; shift ;;
    -h | --help) usage; exit 0 ;;
    *) echo "cuda_compile_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ ! -f $cuda/include/cuda_runtime_api.h ]]; then
  echo "cuda_compile_check: no CUDA toolkit headers at $cuda/include (give --cuda DIR)" >&2
  exit 2
fi
if [[ ! -f $torch/include/c10/cuda/CUDAStream.h ]]; then
  echo "cuda_compile_check: no c10/cuda headers under $torch/include (give --torch PREFIX)" >&2
  exit 2
fi

flags=(-std=c++20 -fsyntax-only -Wall -Wextra -Werror -DUSE_CUDA -DUSE_C10D_GLOO -DSTAGEWISE_WITH_CUDA
       -I"$repo/include" -I"$repo")
[[ $torch == /usr ]] || flags+=(-isystem "$torch/include")
flags+=(-isystem "$torch/include/torch/csrc/api/include" -isystem "$cuda/include")
# The NCCL branches (the NCCL process group of connect and runtime::subgroup) where the toolkit
# has NCCL's header: ProcessGroupNCCL.hpp needs it.
if [[ -f $cuda/include/nccl.h ]]; then
  flags+=(-DUSE_C10D_NCCL)
else
  echo "cuda_compile_check: no nccl.h under $cuda/include: the NCCL branches are not compiled" >&2
fi
# Debian's CPU build has no generated CUDA config header; c10 lets it be skipped.
[[ -f $torch/include/c10/cuda/impl/cuda_cmake_macros.h ]] ||
  flags+=(-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE)

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

all=$work/all_headers_cuda.cpp
(cd "$repo/include" && find stagewise -name '*.hpp' | sort | sed 's|.*|#include "&"|') >"$all"
cases=("$all" "$repo/tests/cuda/cuda_paths.cpp")
while IFS= read -r f; do cases+=("$f"); done < <(find "$repo/tests" -name '*_cuda_test.cpp' | sort)
cases+=("$repo/benchmarks/pipe_cuda.cpp")

export work
compile_one() {
  local src=$1 log
  log=$work/$(basename "$src").log
  if g++ "${@:2}" "$src" >"$log" 2>&1; then echo "PASSED $src"; else echo "FAILED $src"; fi
}
export -f compile_one

printf '%s\n' "${cases[@]}" |
  xargs -P "$jobs" -I{} bash -c 'compile_one "$@"' _ {} "${flags[@]}" >"$work/results"

passed=0
failed=0
while read -r status src; do
  name=${src#"$repo"/}
  [[ $src == "$all" ]] && name="every header in include/stagewise (one translation unit)"
  echo "cuda compile: $status $name"
  if [[ $status == PASSED ]]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    grep -E 'error|note: ' "$work/$(basename "$src").log" | head -n 30
  fi
done < <(sort -k2 "$work/results")
echo "${passed} passed, ${failed} failed"
((failed == 0))
