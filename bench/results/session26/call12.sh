#!/bin/bash
# Session 26, call 12: 12-bit experts on a prefill chunk (4,096 tokens).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 400 python3 .dev/packed_prefill.py 4096 2>&1 | grep -v Warn | tee $OUT/packed_prefill.txt
echo "done at $((SECONDS - S)) s"
