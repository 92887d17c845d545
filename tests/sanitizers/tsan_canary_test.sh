#!/usr/bin/env bash
# Must-fail check: the racy canary (tsan_canary.cpp, always built with -fsanitize=thread) must be
# REPORTED by ThreadSanitizer under the project's suppressions (sanitizer_defaults.cpp): of its two
# data races (one in a custom Function's backward, one in an AccumulateGrad post hook) at least one
# is reported, with the canary's frame and LibTorch's autograd engine (libtorch_cpu.so) on the
# stack, and there is no other report. Then, as a control, the old blanket suppressions (`race:` on LibTorch's libraries) must
# hide both: the blindness this check guards against.
#   usage: tsan_canary_test.sh CANARY [--allow-skip]
# --allow-skip (given under --config=asan, where the canary cannot also carry ThreadSanitizer)
# lets a canary built without ThreadSanitizer pass as skipped; otherwise that fails.
set -uo pipefail
canary=$1
allow_skip=${2:-}

fail() {
  echo "tsan_canary_test: FAILED: $*" >&2
  exit 1
}

# Whatever the environment says, let every report through to count them.
export TSAN_OPTIONS="${TSAN_OPTIONS:-} halt_on_error=0 exitcode=66 report_signal_unsafe=0"

out=$("$canary" 2>&1)
rc=$?
if [[ $rc -eq 3 && $out == *"not built with ThreadSanitizer"* ]]; then
  [[ $allow_skip == --allow-skip ]] || fail "the canary was built without ThreadSanitizer"
  echo "tsan_canary_test: skipped (canary built without ThreadSanitizer in this configuration)"
  exit 0
fi
echo "$out"
[[ $rc -eq 66 ]] || fail "expected ThreadSanitizer's exit code 66 (races reported), got $rc"

# Split the output into one block per report.
reports=$(awk '/^WARNING: ThreadSanitizer:/{n++} n{print n "\t" $0}' <<<"$out")
total=$(grep -c '^WARNING: ThreadSanitizer:' <<<"$out")
# How many reports there are is not a contract: ThreadSanitizer reports a race only when it saw the
# two accesses unordered, and reports one pair of stacks once. What must hold: at least one of the
# canary's races is reported, every report is one of the canary's, and each has LibTorch's engine
# on its stack.
[[ $total -ge 1 ]] || fail "no ThreadSanitizer report at all"
for n in $(seq 1 "$total"); do
  block=$(awk -F'\t' -v n="$n" '$1 == n {print $2}' <<<"$reports")
  grep -q 'WARNING: ThreadSanitizer: data race' <<<"$block" ||
    fail "report $n is not a data race: $(head -1 <<<"$block")"
  grep -q 'canary_backward_write\|canary_hook_write' <<<"$block" ||
    fail "report $n names neither canary race (a race the suppressions should hide, or a new one)"
done
found=0
for frame in canary_backward_write canary_hook_write; do
  n=$(awk -F'\t' -v f="$frame" '$2 ~ f {print $1}' <<<"$reports" | sort -u)
  [[ -n $n ]] || { echo "tsan_canary_test: $frame not reported in this run"; continue; }
  found=$((found + 1))
  block=$(awk -F'\t' -v n="$(head -1 <<<"$n")" '$1 == n {print $2}' <<<"$reports")
  [[ $(grep -c "$frame" <<<"$block") -ge 2 ]] || fail "$frame is not on both stacks"
  # TSan's stacks keep only the LibTorch frame that called into instrumented code: here the
  # engine's call of the backward function or hook, in libtorch_cpu.so.
  grep -q 'libtorch_cpu.so' <<<"$block" ||
    fail "$frame: the report does not show LibTorch's autograd engine (libtorch_cpu.so) on the stack"
done
[[ $found -ge 1 ]] || fail "neither canary race was reported"
echo "tsan_canary_test: $found of the canary's 2 races reported ($total reports, all the canary's), with LibTorch's autograd engine on their stacks"

# Control: the suppressions this project used before (a `race:` entry matches any frame of either
# stack, so every race reached through LibTorch) hide the very same races.
old=$(mktemp)
trap 'rm -f "$old"' EXIT
printf 'race:libtorch_cpu.so\nrace:libtorch.so\nrace:libc10.so\nrace:libgomp.so\nrace:libdnnl.so\n' >"$old"
out=$(TSAN_OPTIONS="$TSAN_OPTIONS suppressions=$old" "$canary" 2>&1)
rc=$?
[[ $rc -eq 0 ]] || fail "control: expected the old suppressions to hide the races (rc $rc): $out"
echo "tsan_canary_test: control: the old blanket suppressions hide both races, as expected"
