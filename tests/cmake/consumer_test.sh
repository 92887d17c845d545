#!/usr/bin/env bash
# Installs stagewise with CMake, builds a downstream project with find_package(stagewise), runs it.
set -euo pipefail
work="${TEST_TMPDIR:-$(mktemp -d)}/cmake_consumer"
rm -rf "$work" && mkdir -p "$work/src"
# Runfiles are symlinks: copy real files so `cmake --install` installs headers, not links.
cp -rL CMakeLists.txt cmake include "$work/src/"
mkdir -p "$work/src/tests" && cp -L tests/doctest_main.cpp "$work/src/tests/"
cp -rL tests/cmake/consumer "$work/consumer"
cmake -S "$work/src" -B "$work/lib" -DCMAKE_INSTALL_PREFIX="$work/prefix" >"$work/log" 2>&1 ||
  { cat "$work/log"; exit 1; }
cmake --install "$work/lib" >>"$work/log" 2>&1 || { cat "$work/log"; exit 1; }
cmake -S "$work/consumer" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" >>"$work/log" 2>&1 ||
  { cat "$work/log"; exit 1; }
cmake --build "$work/build" >>"$work/log" 2>&1 || { cat "$work/log"; exit 1; }
if grep -q "warning:" "$work/log"; then
  echo "the consumer build printed warnings:"; grep -A3 "warning:" "$work/log"; exit 1
fi
out=$("$work/build/consumer")
echo "$out"
grep -q "^consumer ok" <<<"$out"
