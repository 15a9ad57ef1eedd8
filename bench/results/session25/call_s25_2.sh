#!/bin/bash
# Session 25, call 2: the expert kernels on tiles of two or more programs an SM; the fastest in the step.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
timeout 420 python3 .dev/occupancy_probe.py $OUT/occupancy_probe.json 2>&1 | grep -v Warn | tee $OUT/occupancy_probe.txt
echo "done at $((SECONDS - S)) s"
