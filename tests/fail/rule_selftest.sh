#!/usr/bin/env bash
# The must-not-compile rule must report failure when its file compiles.
set -u
if out=$(tools/bazel/compile_fail.sh tests/fail/testdata/compiles.cpp); then
  echo "FAIL: compile_fail.sh accepted a file that compiles:"; echo "$out"; exit 1
fi
grep -q "compiled, but it must not" <<<"$out" || { echo "FAIL: unexpected message: $out"; exit 1; }
echo "PASS: $out"
