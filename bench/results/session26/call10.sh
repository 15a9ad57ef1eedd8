#!/bin/bash
# Session 26, call 10: power of the gate_up kernels sustained (x zero, block_m 16), against a plain read and a copy.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 400 python3 .dev/packed_probe4.py $OUT/packed_power.json 2>&1 | grep -v Warn | tee $OUT/packed_power.txt
echo "done at $((SECONDS - S)) s"
