#!/bin/bash
# Session 26, call 11: power of streaming the gate_up bytes by TMA or plain loads, summed or multiplied.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 400 python3 .dev/power_paths.py $OUT/power_paths.json 2>&1 | grep -v Warn | tee $OUT/power_paths.txt
echo "done at $((SECONDS - S)) s"
