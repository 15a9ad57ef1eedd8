#!/bin/bash
# Session 25, call 3: the graphed step's kernel timeline (gaps between kernels) at 1k and 32k.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
timeout 400 python3 .dev/gap_trace.py $OUT/gap_trace.json 2>&1 | grep -v Warn | tee $OUT/gap_trace.txt
cp /tmp/trace_1024.json $OUT/ 2>/dev/null; gzip -9 $OUT/trace_1024.json 2>/dev/null
echo "done at $((SECONDS - S)) s"
