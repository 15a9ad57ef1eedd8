#!/bin/bash
# Session 25, call 1: tests/gpu (the review mends of 282e4e9 and the overlap's tests), then the overlap A/B.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 200 python3 -m pytest tests/gpu -q -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
grep -E "passed|failed|Error|FAILED" $OUT/gpu_tests.txt | tail -8; echo "tests done at $((SECONDS - S)) s"
timeout 300 python3 .dev/overlap_ab.py $OUT/overlap_ab.json 1024 32768 2>&1 | grep -v Warn | tee $OUT/overlap_ab.txt
echo "ab done at $((SECONDS - S)) s"
