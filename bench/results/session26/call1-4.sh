#!/bin/bash
# Session 26, calls 1-4: expert weights in 12 bits (lossless), decoded in the gate_up kernel (packed_probe.py as it stood at each call).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 400 python3 .dev/packed_probe.py $OUT/packed_probe.json 2>&1 | grep -v Warn | tee $OUT/packed_probe.txt
echo "done at $((SECONDS - S)) s"
