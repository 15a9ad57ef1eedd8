#!/bin/bash
# Session 25, call 5: the post_ffn kernel with its independent loads first, at 4/8/16 warps, alone.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
timeout 200 python3 .dev/post_ffn_probe.py $OUT/post_ffn_probe.json 2>&1 | grep -v -i warn | tee $OUT/post_ffn_probe.txt
