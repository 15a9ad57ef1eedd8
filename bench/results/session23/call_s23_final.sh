#!/bin/bash
# Session 23, call 9: tests/gpu on the final tree, the step and generation (our engine alone), the switch cost.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/gpu_tests.txt 2>&1
tail -2 $OUT/gpu_tests.txt; grep -E "^(FAILED|ERROR)" $OUT/gpu_tests.txt | head; echo "tests done at $((SECONDS - S)) s"
timeout 150 python3 -m diffgemma.cli bench --contexts 1024,32768 --gen-steps 48 --out $OUT/h200_final.json > $OUT/bench_final.txt 2>&1
grep -v Warn $OUT/bench_final.txt | grep "diffgemma"; echo "bench done at $((SECONDS - S)) s"
timeout 100 python3 .dev/switch_cost.py 2>&1 | grep -v Warn | grep "median\|GiB"
echo "switch done at $((SECONDS - S)) s"
