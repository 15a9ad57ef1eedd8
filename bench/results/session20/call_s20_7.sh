#!/bin/bash
# Session 20, call 7: the chat turn's prefill, 0.28-0.32 s in the full run against 0.26 in session 19's (another
# machine): generate_overhead's chat case at 0471158 (before the prefill's one-read softmax, 936d44b) and at HEAD,
# alternately in one call.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
S=$SECONDS
export PYTHONUNBUFFERED=1
for v in old new old new; do
  if [ $v = old ]; then R=.dev/v0471158; else R=.; fi
  PYTHONPATH=/tmp/site:$R/src timeout 60 python3 $R/bench/generate_overhead.py --prompt 200 --f32-max 256 --out $OUT/chat_$v.json 2>&1 | grep -v Warn | grep "run [123]\|median" | sed "s/^/$v: /"
  echo "$v done at $((SECONDS - S)) s"
done
