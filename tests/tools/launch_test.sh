#!/usr/bin/env bash
# tools/launch: starts N ranks with the torchrun environment and prefixes their output; when one
# rank fails it stops the others and exits with that status, or with --elastic starts the job
# again on fewer ranks; --timeout stops every rank; every started process is gone when launch
# returns.
set -uo pipefail
launch="$1"
tmp="${TEST_TMPDIR:-$(mktemp -d)}"
fail=0
check() {  # description, condition (as a string for bash)
  if eval "$2"; then echo "ok   $1"; else echo "FAIL $1"; fail=1; fi
}

out=$("$launch" -n 3 -- bash -c 'echo "hello $RANK of $WORLD_SIZE at $MASTER_ADDR:$MASTER_PORT local $LOCAL_RANK"; echo "err $RANK" >&2')
rc=$?
echo "$out"
check "three ranks run and exit 0" '[[ $rc == 0 ]]'
for k in 0 1 2; do
  check "rank $k's stdout is prefixed and has its environment" \
    "grep -Eq '^\[rank $k\] hello $k of 3 at 127\.0\.0\.1:[0-9]+ local $k\$' <<<\"\$out\""
  check "rank $k's stderr is forwarded with the prefix" "grep -q '^\[rank $k\] err $k\$' <<<\"\$out\""
done
check "all ranks share one MASTER_PORT" \
  "[[ \$(grep -o '127.0.0.1:[0-9]*' <<<\"\$out\" | sort -u | wc -l) == 1 ]]"

rm -f "$tmp"/pid.*
start=$SECONDS
err=$("$launch" -n 3 -- bash -c 'echo $$ > '"$tmp"'/pid.$RANK; if [[ $RANK == 1 ]]; then sleep 0.5; exit 3; fi; exec sleep 100' 2>&1)
rc=$?
echo "$err"
check "a failing rank's status is launch's status" '[[ $rc == 3 ]]'
check "the failure is named" "grep -q '^launch: rank 1 exited with status 3; stopping the other ranks\$' <<<\"\$err\""
check "the other ranks are stopped at once" '((SECONDS - start < 20))'
for f in "$tmp"/pid.*; do
  check "rank process $(cat "$f") is gone" "! kill -0 $(cat "$f") 2>/dev/null"
done

start=$SECONDS
err=$("$launch" -n 2 --timeout 1 -- sleep 100 2>&1)
rc=$?
check "--timeout stops the ranks and exits 124" '[[ $rc == 124 ]]'
check "the timeout is named" "grep -q 'launch: the ranks ran longer than --timeout 1 s; stopping them' <<<\"\$err\""
check "the timeout is prompt" '((SECONDS - start < 20))'

# --elastic: rank 2 of 3 fails; the job starts again on 2 ranks, told it is restart 1.
out=$("$launch" -n 3 --elastic 2 -- bash -c 'echo "run $TORCHELASTIC_RESTART_COUNT: $RANK of $WORLD_SIZE"
  if [[ $WORLD_SIZE == 3 && $RANK == 2 ]]; then sleep 0.3; exit 5; fi
  if [[ $WORLD_SIZE == 3 ]]; then exec sleep 100; fi' 2>&1)
rc=$?
echo "$out"
check "an elastic job that ends well on fewer ranks exits 0" '[[ $rc == 0 ]]'
check "the failure is named" "grep -q '^launch: rank 2 exited with status 5; stopping the other ranks\$' <<<\"\$out\""
check "the restart is named" \
  "grep -q '^launch: the job on 3 ranks failed; restarting it on 2 ranks (restart 1 of 1)\$' <<<\"\$out\""
for k in 0 1; do
  check "rank $k ran first on 3 ranks, then on 2 as restart 1" \
    "grep -q '^\[rank $k\] run 0: $k of 3\$' <<<\"\$out\" && grep -q '^\[rank $k\] run 1: $k of 2\$' <<<\"\$out\""
done
check "no third rank on the restart" "! grep -q 'run 1: 2 of' <<<\"\$out\""
out=$("$launch" -n 2 --elastic 2,1 -- bash -c 'echo "try $TORCHELASTIC_RESTART_COUNT"; exit 7' 2>&1)
rc=$?
check "a job that fails on every restart exits with the last failure" '[[ $rc == 7 ]]'
check "each restart is named" \
  "grep -q 'restarting it on 2 ranks (restart 1 of 2)' <<<\"\$out\" && grep -q 'restarting it on 1 ranks (restart 2 of 2)' <<<\"\$out\""
check "the last try ran" "grep -q '^\[rank 0\] try 2\$' <<<\"\$out\""
err=$("$launch" -n 2 --elastic 0 -- true 2>&1)
rc=$?
check "a bad --elastic is a usage error" '[[ $rc == 2 ]] && grep -q "launch: --elastic needs numbers of ranks >= 1" <<<"$err"'

err=$("$launch" -- true 2>&1)
rc=$?
check "a missing -n is a usage error" '[[ $rc == 2 ]] && grep -q "launch: -n needs a number of ranks >= 1" <<<"$err"'
err=$("$launch" -n 2 2>&1)
rc=$?
check "a missing program is a usage error" '[[ $rc == 2 ]] && grep -q "launch: no program given after --" <<<"$err"'
exit $fail
