#!/usr/bin/env bash
# Runs //tools:schedule_svg for each schedule and checks the picture: it starts with <svg, ends
# with </svg>, has one <rect> per action, and the tool rejects bad arguments with a message.
set -euo pipefail
tool="$1"
out="${TEST_TMPDIR:-/tmp}"
fail=0

check() {  # name expected_actions args...
  local name="$1" expected="$2"
  shift 2
  local file="$out/$name.svg"
  local summary
  summary=$("$tool" "$@" --out="$file")
  local rects
  rects=$(grep -o '<rect' "$file" | wc -l)
  local actions
  actions=$(sed -n 's/.* actions=\([0-9]*\).*/\1/p' <<<"$summary")
  if [[ "$(head -c 4 "$file")" != "<svg" || "$(tail -n 1 "$file")" != "</svg>" ]]; then
    echo "FAIL $name: not a <svg>...</svg> document"; fail=1
  fi
  if [[ "$rects" != "$expected" || "$actions" != "$expected" ]]; then
    echo "FAIL $name: $rects boxes, tool says $actions actions, expected $expected"; fail=1
  fi
  if [[ $(grep -o '<text' "$file" | wc -l) != $(grep -o '</text>' "$file" | wc -l) ]]; then
    echo "FAIL $name: unbalanced <text>"; fail=1
  fi
  echo "ok $name: $summary"
}

check gpipe 64 --schedule=gpipe --stages=4 --micro=8
check one_f_one_b 64 --schedule=one_f_one_b --stages=4 --micro=8
check interleaved 128 --schedule=interleaved_one_f_one_b --stages=4 --micro=8 --virtual=2
check zero_bubble 96 --schedule=zero_bubble_h1 --stages=4 --micro=8
check looped_bfs 128 --schedule=looped_bfs --stages=4 --micro=8 --virtual=2
check zero_bubble_v 192 --schedule=zero_bubble_v --stages=4 --micro=8
check dualpipe_v 150 --schedule=dualpipe_v --stages=4 --micro=8
check v_half 192 --schedule=v_half --stages=4 --micro=8
check v_min 192 --schedule=v_min --stages=4 --micro=8
check checkpointed 96 --schedule=one_f_one_b --stages=4 --micro=8 --checkpointed=8

expect_error() {  # text args...
  local text="$1"
  shift
  if "$tool" "$@" 2>"$out/err.txt" >/dev/null; then
    echo "FAIL: '$*' should have failed"; fail=1
  elif ! grep -qF -- "$text" "$out/err.txt"; then
    echo "FAIL: '$*' said: $(cat "$out/err.txt")"; fail=1
  fi
}
expect_error "unknown schedule 'pipedream'" --schedule=pipedream --stages=2 --micro=2 --out="$out/x.svg"
expect_error "--micro is missing" --schedule=gpipe --stages=2 --out="$out/x.svg"
expect_error "needs at least 2 x workers = 8 micro-batches" --schedule=dualpipe_v --stages=4 --micro=6 --out="$out/x.svg"
expect_error "--virtual applies to interleaved_one_f_one_b and looped_bfs only" --schedule=gpipe --stages=2 --micro=2 --virtual=2 --out="$out/x.svg"
expect_error "cannot open '/no/such/dir/x.svg'" --schedule=gpipe --stages=2 --micro=2 --out=/no/such/dir/x.svg
exit $fail
