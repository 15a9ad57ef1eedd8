#!/bin/bash
# Session 20, call 1: tests/gpu at HEAD (cedfe67 and 83cbb51 had not run on a GPU), the tiled-gate_up probe,
# the step at 1k and 32k.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
S=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/gpu > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt; echo "tests done at $((SECONDS - S)) s"
timeout 150 python3 .dev/tiled_ab.py > $OUT/tiled_ab.txt 2>&1; grep -v Warn $OUT/tiled_ab.txt | tail -40; echo "probe done at $((SECONDS - S)) s"
timeout 150 python3 -m diffgemma.cli bench --contexts 1024,32768 --gen-steps 0 --out $OUT/step.json > $OUT/step.txt 2>&1; grep "diffgemma ctx" $OUT/step.txt
echo "all done at $((SECONDS - S)) s"
