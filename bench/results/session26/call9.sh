#!/bin/bash
# Session 26, call 9: the 8-instruction decode, and each kernel sustained for ~3 s with the power sampled (packed_probe4.py kernels).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 400 python3 .dev/packed_probe4.py $OUT/packed_probe4.json 2>&1 | grep -v Warn | tee $OUT/packed_probe4.txt
echo "done at $((SECONDS - S)) s"
