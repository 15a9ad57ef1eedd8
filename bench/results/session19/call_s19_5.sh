#!/bin/bash
# Session 19, call 5: the full layers' attention with one read of the scores (exp_to + divide_rows): GPU tests,
# one layer alone at 1k-128k, the denoise step A/B at 1k and 32k.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
S=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels.py > $OUT/gpu_tests_kernels.txt 2>&1
tail -3 $OUT/gpu_tests_kernels.txt; echo "tests done at $((SECONDS - S)) s"
timeout 330 python3 .dev/attn512_ab.py > $OUT/attn512_ab.txt 2>&1; grep -v Warn $OUT/attn512_ab.txt | tail -20; echo "all done at $((SECONDS - S)) s"
