#!/bin/bash
# Session 19, call 7: the prefill's full-layer attention on exp_to + divide_rows: GPU kernel tests, a chunk's
# attention old/new, prefill at 32k old/new.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
S=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py > $OUT/gpu_tests_kernels.txt 2>&1
tail -3 $OUT/gpu_tests_kernels.txt; echo "tests done at $((SECONDS - S)) s"
timeout 120 python3 .dev/prefill_ab.py > $OUT/prefill_ab.txt 2>&1; grep -v Warn $OUT/prefill_ab.txt | tail -14; echo "all done at $((SECONDS - S)) s"
