#!/bin/bash
# Session 23, call 8: the step after the shared-buffer graphs (our engine alone, 1k and 32k), generation overhead, switch cost.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
timeout 200 python3 -m diffgemma.cli bench --contexts 1024,32768 --gen-steps 48 --out $OUT/h200_check.json > $OUT/bench_check.txt 2>&1
grep -v Warn $OUT/bench_check.txt | tail -12; echo "bench done at $((SECONDS - S)) s"
timeout 60 python3 bench/generate_overhead.py --out $OUT/gen_1k.json 2>&1 | grep -v Warn | tail -6
echo "gen done at $((SECONDS - S)) s"
timeout 100 python3 .dev/switch_cost.py 2>&1 | grep -v Warn | grep "median\|GiB"
echo "switch done at $((SECONDS - S)) s"
