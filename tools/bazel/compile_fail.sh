#!/usr/bin/env bash
# Must-not-compile check: the source must fail to compile, and the compiler's output must contain
# the text of every `// expect-error: TEXT` line in it. Runs from the runfiles root.
#   compile_fail.sh SRC [PCH]
# PCH: LibTorch's headers precompiled (//tools/bazel:torch_pch's torch_prefix.hpp), included first so
# that only stagewise's code is parsed; the expected texts are stagewise's own diagnostics.
set -uo pipefail
src="$1"
pch=()
[[ -n ${2:-} ]] && pch=(-Winvalid-pch -include "$PWD/$2")
[[ -f "$src" ]] || { echo "compile_fail: no such file: $src"; exit 1; }
mapfile -t expected < <(sed -n 's|^[[:space:]]*// expect-error: ||p' "$src")
if ((${#expected[@]} == 0)); then
  echo "compile_fail: $src has no '// expect-error: TEXT' line saying which diagnostic it expects"
  exit 1
fi
cxx="${CXX:-g++}"
torch_api="${STAGEWISE_TORCH_API_INCLUDE:-/usr/include/torch/csrc/api/include}"
log=$(mktemp)
if "$cxx" -std=c++20 -fsyntax-only "${pch[@]}" -Iinclude -isystem "$torch_api" "$src" >"$log" 2>&1; then
  echo "compile_fail: $src compiled, but it must not (expected: ${expected[*]})"
  exit 1
fi
status=0
for text in "${expected[@]}"; do
  if ! grep -qF -- "$text" "$log"; then
    echo "compile_fail: $src failed to compile, but without the expected text: $text"
    status=1
  fi
done
if ((status)); then
  echo "----- compiler output -----"
  head -c 20000 "$log"
else
  echo "compile_fail: $src is rejected as expected"
fi
rm -f "$log"
exit $status
