#!/usr/bin/env bash
# tools/check_layers: the real tree has no problem; a made-up tree with one of each problem gets
# each named, and a non-zero exit.
#   usage: check_layers_test.sh CHECK_LAYERS HEADERS_ROOT
set -uo pipefail
check=$1
root=$2

fail() {
  echo "check_layers_test: FAILED: $*" >&2
  exit 1
}

out=$("$check" "$root") || fail "the project's own headers: $out"
grep -q '^check_layers: 0 problems in [0-9]* headers$' <<<"$out" || fail "unexpected output: $out"

bad=$(mktemp -d)
trap 'rm -rf "$bad"' EXIT
inc=$bad/include/stagewise
mkdir -p "$inc/core/detail" "$inc/runtime/detail" "$inc/skip" "$inc/misc" "$inc/plan/detail"
# core includes runtime: a layer above its own.
printf '#pragma once\n#include "stagewise/runtime/cell.hpp"\nnamespace stagewise {}\n' >"$inc/core/a.hpp"
printf '#pragma once\n#include "stagewise/core/a.hpp"\nnamespace stagewise::runtime {}\n' \
  >"$inc/runtime/cell.hpp"
# A private header in the wrong namespace, and one in the right one.
printf '#pragma once\nnamespace stagewise::detail {}  // namespace stagewise::detail\n' \
  >"$inc/runtime/detail/wrong.hpp"
printf '#pragma once\nnamespace stagewise::runtime::detail {\n}  // namespace stagewise::runtime::detail\n' \
  >"$inc/runtime/detail/right.hpp"
# plan/detail/ may also hold the memory model's stagewise::schedule::detail, but no other.
printf '#pragma once\nnamespace stagewise::schedule::detail {\n}  // namespace stagewise::schedule::detail\n' \
  >"$inc/plan/detail/model.hpp"
printf '#pragma once\nnamespace stagewise::runtime::detail {\n}  // namespace stagewise::runtime::detail\n' \
  >"$inc/plan/detail/wrong.hpp"
# A public header holding only detail code.
printf '#pragma once\nnamespace stagewise::detail {\n}  // namespace stagewise::detail\n' \
  >"$inc/skip/only_detail.hpp"
# A folder that is no layer; an include of a missing header; the umbrella including private code.
printf '#pragma once\nnamespace stagewise {}\n' >"$inc/misc/m.hpp"
printf '#pragma once\n#include "stagewise/skip/gone.hpp"\nnamespace stagewise {}\n' >"$inc/skip/b.hpp"
printf '#pragma once\n#include "stagewise/runtime/detail/right.hpp"\n#include "stagewise/core/a.hpp"\n#include "stagewise/runtime/c10d/t.hpp"\n' \
  >"$inc/stagewise.hpp"
# The umbrellas: stagewise.hpp reaches core/a.hpp and, through it, runtime/cell.hpp, but not
# skip/b.hpp, skip/only_detail.hpp or misc/m.hpp; and it reaches a header of the distributed form.
mkdir -p "$inc/runtime/c10d"
printf '#pragma once\nnamespace stagewise::runtime {}\n' >"$inc/runtime/c10d/t.hpp"
printf '#pragma once\n#include "stagewise/runtime/c10d/t.hpp"\n' >"$inc/distributed.hpp"

out=$("$check" "$bad")
rc=$?
echo "$out"
[[ $rc -eq 1 ]] || fail "expected exit 1 on a bad tree, got $rc"
expect() {
  grep -qF -- "$1" <<<"$out" || fail "missing: $1"
}
expect "core/a.hpp (layer core) includes stagewise/runtime/cell.hpp (layer runtime), a higher one"
expect "include cycle: core/a.hpp -> runtime/cell.hpp -> core/a.hpp"
expect "runtime/detail/wrong.hpp: private header opens namespace stagewise::detail; its folder says stagewise::runtime::detail"
expect "plan/detail/wrong.hpp: private header opens namespace stagewise::runtime::detail; its folder says stagewise::detail"
expect "skip/only_detail.hpp: holds only detail code; it belongs in a detail/ folder"
expect "misc/m.hpp: not in a layer folder"
expect "skip/b.hpp: includes stagewise/skip/gone.hpp, which does not exist"
expect "stagewise.hpp includes the private header stagewise/runtime/detail/right.hpp"
expect "skip/b.hpp: public, but stagewise.hpp does not include it (directly or through another header); add #include \"stagewise/skip/b.hpp\" to it"
expect "skip/only_detail.hpp: public, but stagewise.hpp does not include it"
expect "misc/m.hpp: public, but stagewise.hpp does not include it"
expect "stagewise.hpp reaches runtime/c10d/t.hpp, a header of the distributed form; include it from distributed.hpp only"
grep -q "right.hpp: private" <<<"$out" && fail "a private header in its folder's namespace was reported"
grep -q "model.hpp: private" <<<"$out" && fail "plan/detail's memory model namespace was reported"
grep -q "cell.hpp: public" <<<"$out" && fail "a header the umbrella reaches through another was reported"
expect "check_layers: 12 problems in 12 headers"
echo "check_layers_test: passed"
