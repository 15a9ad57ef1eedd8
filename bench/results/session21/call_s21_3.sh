#!/bin/bash
# Session 21 call 3 (branch next-commit-graph): tests/gpu, the commit A/B at the real shape, generation twice.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
S=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
timeout 220 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt; grep -E "^FAILED|Error" $OUT/gpu_tests.txt | head -20; echo "tests done at $((SECONDS - S)) s"
timeout 150 python3 .dev/commit_ab.py > $OUT/commit_ab.txt 2>&1; grep -v Warn $OUT/commit_ab.txt | tail -12; echo "commit A/B done at $((SECONDS - S)) s"
timeout 60 python3 bench/generate_overhead.py --out $OUT/gen_1k.json 2>&1 | grep -v Warn | tail -3
timeout 60 python3 bench/generate_overhead.py --prompt 200 --f32-max 256 --out $OUT/gen_chat.json 2>&1 | grep -v Warn | tail -3
echo "all done at $((SECONDS - S)) s"
