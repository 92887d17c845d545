#!/usr/bin/env bash
# Must-fail check: the racy canary (tsan_canary.cpp, always built with -fsanitize=thread) must be
# REPORTED by ThreadSanitizer under the project's suppressions (sanitizer_defaults.cpp): two data
# races, one in a custom Function's backward and one in an AccumulateGrad post hook, each with the
# canary's frame and LibTorch's autograd engine (libtorch_cpu.so) on the stack, and no other
# report. Then, as a control, the old blanket suppressions (`race:` on LibTorch's libraries) must
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
count=$(grep -c '^WARNING: ThreadSanitizer: data race' <<<"$out")
[[ $count -eq 2 ]] || fail "expected exactly 2 data races (the canary's), got $count"
for frame in canary_backward_write canary_hook_write; do
  n=$(awk -F'\t' -v f="$frame" '$2 ~ f {print $1}' <<<"$reports" | sort -u)
  [[ -n $n ]] || fail "no report names $frame"
  [[ $(wc -l <<<"$n") -eq 1 ]] || fail "$frame appears in more than one report"
  block=$(awk -F'\t' -v n="$n" '$1 == n {print $2}' <<<"$reports")
  grep -q 'WARNING: ThreadSanitizer: data race' <<<"$block" || fail "$frame: not a data race"
  [[ $(grep -c "$frame" <<<"$block") -ge 2 ]] || fail "$frame is not on both stacks"
  # TSan's stacks keep only the LibTorch frame that called into instrumented code: here the
  # engine's call of the backward function or hook, in libtorch_cpu.so.
  grep -q 'libtorch_cpu.so' <<<"$block" ||
    fail "$frame: the report does not show LibTorch's autograd engine (libtorch_cpu.so) on the stack"
done
echo "tsan_canary_test: both races reported, with LibTorch's autograd engine on their stacks"

# Control: the suppressions this project used before (a `race:` entry matches any frame of either
# stack, so every race reached through LibTorch) hide the very same races.
old=$(mktemp)
trap 'rm -f "$old"' EXIT
printf 'race:libtorch_cpu.so\nrace:libtorch.so\nrace:libc10.so\nrace:libgomp.so\nrace:libdnnl.so\n' >"$old"
out=$(TSAN_OPTIONS="$TSAN_OPTIONS suppressions=$old" "$canary" 2>&1)
rc=$?
[[ $rc -eq 0 ]] || fail "control: expected the old suppressions to hide the races (rc $rc): $out"
echo "tsan_canary_test: control: the old blanket suppressions hide both races, as expected"
