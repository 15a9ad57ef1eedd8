#!/bin/bash
# Session 23, call 12: a one-shot reply's cost with the regions compiled or eager (warm on-disk caches: a first
# compiled process fills them).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
for m in compiled compiled eager compiled eager; do timeout 90 python3 .dev/ask_cold.py $m 2>&1 | grep "^{"; echo "at $((SECONDS - S)) s"; done
