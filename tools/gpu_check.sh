#!/usr/bin/env bash
# The GPU test leg: stagewise's CMake suite and the pipe_cuda benchmark on a CUDA GPU; see --help.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: tools/gpu_check.sh [--doctest DIR] [--gloo DIR] [--python PY] [--cuda DIR]
                          [--build DIR] [--log FILE] [--jobs N] [--parallel N]
                          [--timeout S] [--rounds N]

The GPU leg, for a machine with a CUDA GPU and Python's CUDA torch (no Bazel needed). Against the
LibTorch inside that torch (python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') it
  - configures the CMake build (Ninja when installed) with the tests, the examples and the GPU
    benchmark (-DSTAGEWISE_BUILD_TESTS=ON, STAGEWISE_WITH_CUDA=ON: a CUDA LibTorch must give a
    CUDA build), and builds it all with -j N, going on past a target that fails;
  - runs CTest (--output-on-failure, each test limited to --timeout seconds): every test and
    example, the *_cuda cases and balance_by_size on the GPU included (fp16 with a GradScaler:
    tests/pipe/scaled_cuda_test.cpp);
  - runs benchmarks/pipe_cuda and prints its output: one more case, passed when it exits with 0.
    Its last line holds every GPU key of docs/benchmarks.md, fp16_time_ratio and fp16_peak_ratio
    (section (f): fp32, bf16 and fp16 + GradScaler) and gpu_offload_step_ratio and
    gpu_state_bytes_per_param (section (g): Adam's state in a HostStore, stepped on the host)
    included; CTest runs tests/optim/offloaded_state_cuda_test.cpp's GPU case.
Everything is also written to a log file, named at the start and at the end. The last line is
`gpu_check: N passed, N failed` (CTest's tests plus the benchmark); the exit status is non-zero
when anything failed. Without a CUDA GPU, or without a CUDA torch, it refuses (exit status 2)
and builds nothing.

Needs doctest's single header: the GPU machine has none, so bring doctest.h along (from a Debian
or Ubuntu machine's /usr/include/doctest/doctest.h, package doctest-dev; or doctest/doctest.h
from https://github.com/doctest/doctest) and name it with --doctest. Gloo's headers are optional:
the torch wheel ships none, and without them the distributed tests and example are skipped.

Options:
  --doctest DIR   doctest: DIR/doctest/doctest.h, DIR/doctest.h, or the header file itself
                  (default: the system's /usr/include/doctest/doctest.h)
  --gloo DIR      Gloo's headers: DIR/gloo/context.h, e.g. Debian's libgloo-dev /usr/include/gloo
                  copied to DIR/gloo (default: the system's, when there)
  --python PY     the Python whose torch is used (default python3)
  --cuda DIR      the CUDA toolkit, for CMake's CUDAToolkit (default $CUDA_HOME, else
                  /usr/local/cuda)
  --build DIR     the CMake build directory, kept for the next run (default build/gpu-check)
  --log FILE      the log (default build/gpu_check.log)
  --jobs N        compile jobs (default: the number of cores)
  --parallel N    CTest tests run at once (default 1; they share the GPU, which is fine)
  --timeout S     CTest's limit per test, in seconds (default 600; pipe_cuda gets 1200)
  --rounds N      pipe_cuda's alternating rounds per table (default: pipe_cuda's own, 7)
  -h, --help      this text

Example: tools/gpu_check.sh --doctest ~/doctest --gloo ~/gloo-headers
EOF
}

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
doctest=""
gloo=""
python=python3
cuda=${CUDA_HOME:-/usr/local/cuda}
build=$repo/build/gpu-check
log=$repo/build/gpu_check.log
jobs=$(nproc)
parallel=1
timeout=600
rounds=""
while (($#)); do
  case $1 in
    --doctest | --gloo | --python | --cuda | --build | --log | --jobs | --parallel | --timeout | \
      --rounds)
      if (($# < 2)); then
        echo "gpu_check: $1 needs a value (see --help)" >&2
        exit 2
      fi
      case $1 in
        --doctest) doctest=$2 ;;
        --gloo) gloo=$2 ;;
        --python) python=$2 ;;
        --cuda) cuda=$2 ;;
        --build) build=$2 ;;
        --log) log=$2 ;;
        --jobs) jobs=$2 ;;
        --timeout) timeout=$2 ;;
        --parallel) parallel=$2 ;;
        --rounds) rounds=$2 ;;
      esac
      shift
      ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

refuse() {
  echo "gpu_check: $*" >&2
  echo "gpu_check: refused; nothing was built or run" >&2
  exit 2
}

# A CUDA GPU: the driver lists one.
gpus=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep '^GPU ' || true)
elif compgen -G '/proc/driver/nvidia/gpus/*' >/dev/null; then
  gpus="a GPU in /proc/driver/nvidia/gpus (no nvidia-smi)"
fi
if [[ -z $gpus ]]; then
  refuse "no CUDA GPU found (nvidia-smi lists none, and /proc/driver/nvidia/gpus is empty or" \
    "absent). This leg runs on a machine with an NVIDIA GPU and its driver; without one," \
    "tools/cuda_compile_check.sh compiles the CUDA code paths."
fi

# Python's torch, built with CUDA, seeing the GPU.
if ! command -v "$python" >/dev/null 2>&1; then
  refuse "no Python '$python' (give --python PY, a Python with PyTorch built for CUDA)"
fi
if ! torch_info=$("$python" -c '
import torch
print(torch.utils.cmake_prefix_path)
print(torch.__version__)
print(torch.version.cuda or "")
print(int(torch.cuda.is_available()))
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
' 2>&1); then
  refuse "'$python' cannot import torch ($(tail -n 1 <<<"$torch_info")): install PyTorch built" \
    "for CUDA (pip install torch), or name another Python with --python"
fi
{
  read -r torch_prefix
  read -r torch_version
  read -r torch_cuda
  read -r torch_sees_gpu
  read -r gpu_name
} <<<"$torch_info"
if [[ -z $torch_cuda ]]; then
  refuse "the torch of '$python' ($torch_version) is built without CUDA: install a CUDA build" \
    "of PyTorch, or name a Python that has one with --python"
fi
if [[ $torch_sees_gpu != 1 ]]; then
  refuse "torch $torch_version (CUDA $torch_cuda) sees no GPU (torch.cuda.is_available() is" \
    "False) although the driver lists: $gpus. Check CUDA_VISIBLE_DEVICES and that the driver" \
    "supports CUDA $torch_cuda."
fi

# doctest's single header, copied into the build tree (so that no system directory, which may
# hold another LibTorch's headers, goes on the include path).
if [[ -z $doctest ]]; then
  [[ -f /usr/include/doctest/doctest.h ]] && doctest=/usr/include/doctest/doctest.h
elif [[ -f $doctest/doctest/doctest.h ]]; then
  doctest=$doctest/doctest/doctest.h
elif [[ -f $doctest/doctest.h ]]; then
  doctest=$doctest/doctest.h
fi
if [[ -z $doctest || ! -f $doctest ]]; then
  where=""
  [[ -z $doctest ]] || where=" at $doctest"
  echo "gpu_check: doctest's single header not found${where}." >&2
  echo "  The tests need doctest/doctest.h, and this machine has none. Bring it along:" >&2
  echo "  copy /usr/include/doctest/doctest.h from a Debian/Ubuntu machine (apt-get install" >&2
  echo "  doctest-dev), or doctest/doctest.h from https://github.com/doctest/doctest, into a" >&2
  echo "  directory DIR here, then run: tools/gpu_check.sh --doctest DIR" >&2
  exit 2
fi

# Gloo's headers, for stagewise::distributed: --gloo, else the system's, else none.
if [[ -n $gloo ]]; then
  [[ -f $gloo/gloo/context.h ]] ||
    refuse "--gloo $gloo: no $gloo/gloo/context.h (give the directory that holds gloo/)"
elif [[ -f /usr/include/gloo/context.h ]]; then
  gloo=/usr/include
fi

mkdir -p "$build" "$(dirname "$log")"
log=$(cd "$(dirname "$log")" && pwd)/$(basename "$log")
: >"$log"
say() { echo "gpu_check: $*" | tee -a "$log"; }

say "log: $log"
say "GPU: ${gpu_name} (driver lists: $(head -n 1 <<<"$gpus"))"
say "torch $torch_version (CUDA $torch_cuda) from '$python': LibTorch at $torch_prefix"
say "doctest: $doctest"
if [[ -n $gloo ]]; then
  say "Gloo headers: $gloo/gloo (the distributed tests and example are built)"
else
  say "no Gloo headers (the torch wheel ships none, and the system has no libgloo-dev): the" \
    "distributed tests and example are skipped. For them, give --gloo DIR with DIR/gloo from" \
    "Debian's libgloo-dev (/usr/include/gloo)."
fi

mkdir -p "$build/stagewise_doctest/doctest"
cp "$doctest" "$build/stagewise_doctest/doctest/doctest.h"

configure=(cmake -S "$repo" -B "$build" -DCMAKE_PREFIX_PATH="$torch_prefix"
           -DSTAGEWISE_BUILD_TESTS=ON -DSTAGEWISE_BUILD_BENCHMARKS=ON -DSTAGEWISE_WITH_CUDA=ON
           -DSTAGEWISE_DOCTEST_INCLUDE_DIR="$build/stagewise_doctest")
[[ -n $gloo ]] && configure+=(-DSTAGEWISE_GLOO_INCLUDE_DIR="$gloo")
[[ -d $cuda ]] && configure+=(-DCUDAToolkit_ROOT="$cuda")
# A build directory keeps its generator: Ninja for a new one when installed.
keep_going=(-k)
if [[ -f $build/CMakeCache.txt ]]; then
  grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$build/CMakeCache.txt" && keep_going=(-k 0)
elif command -v ninja >/dev/null 2>&1; then
  configure+=(-G Ninja)
  keep_going=(-k 0)
fi

passed=0
failed=0
finish() {
  say "log: $log"
  echo "gpu_check: ${passed} passed, ${failed} failed" | tee -a "$log"
  if ((failed == 0)); then exit 0; fi
  exit 1
}

say "configuring: ${configure[*]}"
set +e
"${configure[@]}" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
set -e
if ((rc != 0)); then
  say "configure failed (exit status $rc; see the output above or the log)"
  failed=1
  finish
fi

say "building with -j $jobs (going on past failures; CTest counts what did not build)"
start=$SECONDS
set +e
cmake --build "$build" -j "$jobs" -- "${keep_going[@]}" 2>&1 | tee -a "$log"
build_rc=${PIPESTATUS[0]}
set -e
say "build finished in $((SECONDS - start)) s with exit status $build_rc"

say "running CTest"
set +e
(cd "$build" && ctest --output-on-failure --timeout "$timeout" -j "$parallel") 2>&1 |
  tee "$build/ctest_output.txt" | tee -a "$log"
ctest_rc=${PIPESTATUS[0]}
set -e
# "N% tests passed, N tests failed out of N"; CTest 4 leaves out ", 0 tests failed" when none did.
line=$(grep -E '[0-9]+% tests passed(, [0-9]+ tests? failed)? out of [0-9]+' \
  "$build/ctest_output.txt" | tail -n 1 || true)
if [[ -z $line ]]; then
  say "CTest reported no result (exit status $ctest_rc): counted as one failure"
  failed=$((failed + 1))
else
  ctest_failed=0
  if [[ $line =~ ([0-9]+)\ tests?\ failed ]]; then ctest_failed=${BASH_REMATCH[1]}; fi
  ctest_total=$(sed -E 's/.*out of ([0-9]+).*/\1/' <<<"$line")
  passed=$((passed + ctest_total - ctest_failed))
  failed=$((failed + ctest_failed))
fi
if ((build_rc != 0 && failed == 0)); then
  say "the build failed although every CTest test passed: counted as one failure"
  failed=$((failed + 1))
fi

# The benchmark: one case.
if [[ ! -f $repo/benchmarks/pipe_cuda.cpp ]]; then
  say "pipe_cuda: FAILED: benchmarks/pipe_cuda.cpp is missing"
  failed=$((failed + 1))
elif [[ ! -x $build/pipe_cuda ]]; then
  say "pipe_cuda: FAILED: not built (see the build output in the log)"
  failed=$((failed + 1))
else
  bench=("$build/pipe_cuda")
  [[ -n $rounds ]] && bench+=(--rounds "$rounds")
  say "running ${bench[*]}"
  set +e
  timeout 1200 "${bench[@]}" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  set -e
  if ((rc == 0)); then
    say "pipe_cuda: passed"
    passed=$((passed + 1))
  else
    say "pipe_cuda: FAILED with exit status $rc$( ((rc == 124)) && echo ' (timed out after 1200 s)')"
    failed=$((failed + 1))
  fi
fi
finish
