#!/usr/bin/env bash
# Runs an example program as a test: it must exit 0 (examples check what they print).
set -euo pipefail
"$1"
