#!/bin/bash
# Session 23, call 6: tests/gpu at the warm-up commit, then the cost of switching caches between requests.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
git log --oneline | head -1
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/gpu_tests.txt 2>&1
tail -2 $OUT/gpu_tests.txt; echo "tests done at $((SECONDS - S)) s"
timeout 150 python3 .dev/switch_cost.py 2>&1 | grep -v Warn | grep "same\|alternating"
echo "done at $((SECONDS - S)) s"
