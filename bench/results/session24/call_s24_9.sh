#!/bin/bash
# Session 24, call 9: tests/gpu on the final tree; a long prompt's prefill with eager regions (as ask runs it).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
timeout 150 python3 -m pytest tests/gpu -q -x -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
grep -E "passed|failed|Error" $OUT/gpu_tests.txt | tail -5; echo "tests done at $((SECONDS - S)) s"
timeout 120 python3 .dev/ask_long.py $OUT/ask_long.json 2>&1 | grep -v Warn | tail -4
echo "ask_long done at $((SECONDS - S)) s"
