#!/bin/bash
# Session 24, call 1: tests/gpu with the softcap in the sampler's row pass; its A/B probe; our bench alone.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 200 python3 -m pytest tests/gpu -q -x > $OUT/gpu_tests.txt 2>&1
grep -E "passed|failed|Error" $OUT/gpu_tests.txt | tail -5; echo "tests done at $((SECONDS - S)) s"
timeout 220 python3 .dev/softcap_ab.py $OUT/softcap_ab.json 2>&1 | grep -v Warn | tail -8
echo "probe done at $((SECONDS - S)) s"
timeout 150 python3 -m diffgemma.cli bench --contexts 1024,32768 --gen-steps 48 --out $OUT/h200_check.json > $OUT/bench_check.txt 2>&1
grep -v Warn $OUT/bench_check.txt | tail -12; echo "bench done at $((SECONDS - S)) s"
