#!/usr/bin/env bash
# Runs an example program as a test: it must exit 0 (examples check what they print).
#   run_example.sh PROGRAM [ARGS...]   (the examples' one program: ARGS starts with the example)
set -euo pipefail
"$@"
