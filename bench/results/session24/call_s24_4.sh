#!/bin/bash
# Session 24, call 4: tests/gpu on the chunked row pass; generation overhead; expert tiles with 512-B rows.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
timeout 100 python3 .dev/k256_probe.py $OUT/k256_probe.json 2>&1 | grep -v Warn | tail -22
echo "probe done at $((SECONDS - S)) s"
timeout 200 python3 -m pytest tests/gpu -q -x > $OUT/gpu_tests.txt 2>&1
grep -E "passed|failed|Error" $OUT/gpu_tests.txt | tail -5; echo "tests done at $((SECONDS - S)) s"
timeout 150 python3 bench/generate_overhead.py --out $OUT/gen_1k.json 2>&1 | grep -v Warn | tail -6
echo "gen done at $((SECONDS - S)) s"
