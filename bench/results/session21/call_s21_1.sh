#!/bin/bash
# Session 21 call 1: tests/gpu at HEAD + softmax_pv (verifies c8e430c too), the softmax_pv probe (sweep and the
# step A/B at 1k/32k/128k with a prefill beside), bench/moe_kernels.py (its crossover had not run).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
S=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt; grep -E "FAILED|Error" $OUT/gpu_tests.txt | head -20; echo "tests done at $((SECONDS - S)) s"
timeout 240 python3 .dev/pv_probe.py 1024 32768 131072 > $OUT/pv_probe.txt 2>&1
grep -v "^  m" $OUT/pv_probe.txt | grep -v Warn | tail -40; echo "probe done at $((SECONDS - S)) s"
timeout 100 python3 bench/moe_kernels.py --configs m32_s2_tma_swap,prefill > $OUT/moe_kernels.txt 2>&1
tail -30 $OUT/moe_kernels.txt; cp $OUT/moe_kernels.json $OUT/moe_kernels_out.json 2>/dev/null
echo "all done at $((SECONDS - S)) s"
