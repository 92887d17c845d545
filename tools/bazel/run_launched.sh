#!/usr/bin/env bash
# Runs a distributed example as a test: tools/launch starts N ranks of it; every rank must exit 0.
set -euo pipefail
launch="$1"
ranks="$2"
shift 2
"$launch" -n "$ranks" --timeout 240 -- "$@"
