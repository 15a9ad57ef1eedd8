#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
timeout 80 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_triton_moe.py > $OUT/gpu_tests_moe.txt 2>&1; tail -1 $OUT/gpu_tests_moe.txt; echo "tests at $((SECONDS - S)) s"
for v in new old; do
  if [ $v = new ]; then f=bench/fp32_prefill.py; else f=.dev/fp32_prefill_old.py; fi
  timeout 70 python3 $f > $OUT/fp32_prefill_$v.txt 2>&1; echo "$v: $(grep 'fp32 prefill' $OUT/fp32_prefill_$v.txt)"; grep "_gate_up_kernel\|_down_kernel" $OUT/fp32_prefill_$v.txt | awk '{print "   ", $1, $(NF-3), $(NF-1)}'
  echo "at $((SECONDS - S)) s"
done
