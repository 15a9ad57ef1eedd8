#!/bin/bash
# Session 20, call 4: tests/gpu with the prefill experts on Triton; the expert probe at 8k / 16k tokens; prefill
# A/B in one process (grouped against Triton experts, chunks 4k / 8k / 16k) at 1k, 2k, 8k, 32k, then 128k.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
S=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt; echo "tests done at $((SECONDS - S)) s"
timeout 150 python3 .dev/prefill_cfg_ab.py 1024 2048 8192 32768 > $OUT/prefill_ab.txt 2>&1; grep -v Warn $OUT/prefill_ab.txt | tail -20; echo "A/B done at $((SECONDS - S)) s"
for n in 8192 16384; do
  timeout 80 python3 .dev/prefill_moe_probe2.py $n > $OUT/probe2_$n.txt 2>&1; grep -v Warn $OUT/probe2_$n.txt | grep "r1 grouped\|r1 triton m128_s6\|r1 triton m64_n128_s12\|\[" ; echo "N=$n done at $((SECONDS - S)) s"
done
timeout 100 python3 .dev/prefill_cfg_ab.py 131072 > $OUT/prefill_ab_128k.txt 2>&1; grep -v Warn $OUT/prefill_ab_128k.txt | tail -5
echo "all done at $((SECONDS - S)) s"
