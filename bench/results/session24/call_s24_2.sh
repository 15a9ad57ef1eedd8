#!/bin/bash
# Session 24, call 2: the row pass in chunks (programs a row), swept.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
timeout 250 python3 .dev/row_pass_sweep.py $OUT/row_pass_sweep.json 2>&1 | grep -v Warn | tail -40
echo "sweep done at $((SECONDS - S)) s"
timeout 200 python3 -m pytest tests/gpu/test_kernels.py -q -x -k "row_stats" > $OUT/gpu_tests_sampler.txt 2>&1
grep -E "passed|failed|Error" $OUT/gpu_tests_sampler.txt | tail -5; echo "tests done at $((SECONDS - S)) s"
