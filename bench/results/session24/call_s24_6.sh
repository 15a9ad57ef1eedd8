#!/bin/bash
# Session 24, call 6: expert tiles around the 5-stage gate_up; tests/gpu with it (SPLIT3_CONFIG for fp32 x).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
timeout 150 python3 .dev/tiles_probe.py $OUT/tiles_probe.json 2>&1 | grep -v Warn | tail -45
echo "probe done at $((SECONDS - S)) s"
timeout 200 python3 -m pytest tests/gpu -q -x > $OUT/gpu_tests.txt 2>&1
grep -E "passed|failed|Error" $OUT/gpu_tests.txt | tail -5; echo "tests done at $((SECONDS - S)) s"
