#!/bin/bash
# Session 19, call 1: persistent expert kernels. The triton_moe GPU tests (every config), each kernel alone
# (persist_ab.py), then the denoise step in one process for three persistent configs around the default.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
S=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_moe.py > $OUT/gpu_tests_moe.txt 2>&1
tail -3 $OUT/gpu_tests_moe.txt; echo "tests done at $((SECONDS - S)) s"
timeout 150 python3 .dev/persist_ab.py > $OUT/persist_ab.txt 2>&1; grep -v Warn $OUT/persist_ab.txt | tail -60; echo "kernels done at $((SECONDS - S)) s"
timeout 240 python3 .dev/cfg_ab.py m32_s2_tma_swap,persist_a,persist_b,persist_c,m32_s2_tma_swap 1024 32768 > $OUT/step_ab.txt 2>&1; grep -v Warn $OUT/step_ab.txt | tail -14
echo "all done at $((SECONDS - S)) s"
