#!/usr/bin/env bash
# examples/gpt end to end: Python loads its weights with the same logits; --resume is bit for bit
# in one process and on two ranks; the two ranks clip by the whole model's gradient norm (the
# first step's equals the one-process run's); --fp16 is refused on the CPU.
#   gpt_runs_test.sh ALL_EXAMPLES LAUNCH LOAD_IN_PYTHON_PY
set -euo pipefail
examples=$1
launch=$2
load=$3
tmp=${TEST_TMPDIR:-$(mktemp -d)}
small=(--small --batch=8 --eval-every=4 --save-every=2)
gpt() { "$examples" gpt "${small[@]}" "$@"; }
gpt2() { "$launch" -n 2 --timeout 240 -- "$examples" gpt "${small[@]}" "$@"; }
same() {
  if cmp -s "$1" "$2"; then echo "same bytes: $1 $2"; else echo "FAILED: $1 and $2 differ"; exit 1; fi
}

# One process: 4 steps straight; 2 steps, then resumed to 4.
gpt --steps=4 --out="$tmp/one" | tee "$tmp/one.log"
/usr/bin/python3 "$load" "$tmp/one"
gpt --steps=2 --out="$tmp/one_resumed"
gpt --steps=4 --out="$tmp/one_resumed" --resume | tee "$tmp/log"
grep -q "resumed from .*ckpt-1 at step 2" "$tmp/log"
same "$tmp/one/gpt.safetensors" "$tmp/one_resumed/gpt.safetensors"

# Two ranks (each stage in its own process), the same.
gpt2 --steps=4 --out="$tmp/two" | tee "$tmp/two.log"
# The first step's gradient norm (before clipping, 3 decimals) is the whole model's on two ranks
# too: a rank's own stages' norm would be another number.
norm() { grep -o "step    0 .*grad norm [0-9.]*" "$1" | grep -o "[0-9.]*$"; }
one_norm=$(norm "$tmp/one.log")
two_norm=$(norm "$tmp/two.log")
if [[ -z "$one_norm" || "$one_norm" != "$two_norm" ]]; then
  echo "FAILED: the first step's gradient norm is '$one_norm' in one process, '$two_norm' on two ranks"
  exit 1
fi
echo "same first-step gradient norm: $one_norm"
/usr/bin/python3 "$load" "$tmp/two"
gpt2 --steps=2 --out="$tmp/two_resumed"
gpt2 --steps=4 --out="$tmp/two_resumed" --resume
same "$tmp/two/gpt.safetensors" "$tmp/two_resumed/gpt.safetensors"

# A bad flag is a clear error.
if "$examples" gpt --schedule=gpipe 2>"$tmp/err"; then echo "FAILED: a bad flag was accepted"; exit 1; fi
grep -q "schedule takes 1f1b or zb" "$tmp/err"
# --fp16 (autocast with a GradScaler) is for CUDA GPUs: on the CPU it is refused, naming --bf16.
if "$examples" gpt --small --fp16 --device=cpu --out="$tmp/fp16" 2>"$tmp/err"; then
  echo "FAILED: --fp16 ran on the CPU"; exit 1
fi
grep -q "fp16 trains in fp16 on CUDA GPUs .* use --bf16 on the CPU" "$tmp/err"
echo "gpt runs: all passed"
