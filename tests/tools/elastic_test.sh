#!/usr/bin/env bash
# The elastic path (docs/distributed.md, "Resume on other ranks"): examples/elastic on 4 ranks
# loses its last rank at step 3 (SIGKILL); tools/launch --elastic 2 starts the job again on 2
# ranks, which plan a pipeline for 2 (plan_pipeline) and resume from the last complete save
# (step 2's, written by the 4 ranks), and finish the run.
#   elastic_test.sh ALL_EXAMPLES LAUNCH
set -euo pipefail
examples=$1
launch=$2
tmp=${TEST_TMPDIR:-$(mktemp -d)}
expect() {  # description, pattern (grep -E) the log must hold
  if grep -Eq "$2" "$tmp/log"; then echo "ok   $1"; else echo "FAIL $1: no line matches '$2'"; exit 1; fi
}

"$launch" -n 4 --elastic 2 --timeout 400 -- "$examples" elastic --out="$tmp/run" --steps=6 \
  --fail-at=3 2>&1 | tee "$tmp/log"
expect "the 4-rank job trained steps 0 to 2" '^\[rank 0\] step 2 on 4 ranks: loss'
expect "a rank's death stopped the job" '^launch: rank [0-3] exited with status [0-9]+; stopping the other ranks$'
expect "launch started it again on 2 ranks" \
  '^launch: the job on 4 ranks failed; restarting it on 2 ranks \(restart 1 of 1\)$'
expect "the 2-rank job planned again and resumed from step 2's save of 4 ranks" \
  "^\[rank 0\] resumed from $tmp/run/step-2 \(saved by 4 ranks\) at step 3 on 2 ranks: "
expect "and trained on to the last step" '^\[rank 0\] step 5 on 2 ranks: loss'
if grep -Eq '^\[rank 0\] step 3 on 4 ranks' "$tmp/log"; then echo "FAIL step 3 ran on 4 ranks"; exit 1; fi
ls "$tmp/run"
[[ -f "$tmp/run/step-5/index.pt" && -f "$tmp/run/step-5/rank1.pt" && ! -e "$tmp/run/step-5/rank2.pt" ]] ||
  { echo "FAIL the last save is not step 5's, written by 2 ranks"; exit 1; }
echo "elastic: all passed"
