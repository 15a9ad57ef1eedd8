#!/bin/bash
# Session 20, call 5: prefill A/B in one process (grouped against Triton experts, chunks 4k / 8k / 16k) at 1k, 2k,
# 8k, 32k (call 4's run stopped at the graph capture: the script dropped the graphs but kept their pool).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
S=$SECONDS
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
timeout 200 python3 .dev/prefill_cfg_ab.py 1024 2048 8192 32768 > $OUT/prefill_ab.txt 2>&1; grep -v Warn $OUT/prefill_ab.txt | tail -20; echo "A/B done at $((SECONDS - S)) s"
