#!/bin/bash
# Session 20, call 3: the prefill experts under Triton tiles against the grouped chain at 1k / 2k / 4k tokens;
# prefill chunks of 8,192 against 4,096 (the bench at 8k and 32k, 4096 / 8192 / 4096).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
S=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
for n in 1024 2048 4096; do
  timeout 120 python3 .dev/prefill_moe_probe2.py $n > $OUT/probe2_$n.txt 2>&1; grep -v Warn $OUT/probe2_$n.txt | grep "r1\|\[" ; echo "N=$n done at $((SECONDS - S)) s"
done
for c in 4096 8192 4096; do
  timeout 120 python3 -m diffgemma.cli bench --contexts 8192,32768 --gen-steps 0 --prefill-chunk $c --out $OUT/chunk_$c.json > $OUT/chunk_$c.txt 2>&1; grep "diffgemma ctx" $OUT/chunk_$c.txt; echo "chunk $c done at $((SECONDS - S)) s"
done
