#!/bin/bash
# Session 26, call 7: the denoise step with 12-bit experts against the kept kernels (one process, rounds).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
timeout 500 python3 .dev/packed_step_ab.py 1024 32768 2>&1 | grep -v Warn | tee $OUT/packed_step_ab.txt
echo "done at $((SECONDS - S)) s"
