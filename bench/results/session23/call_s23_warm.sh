#!/bin/bash
# Session 23, call 4: Engine.warm_up on the device (its GPU test), then the cold-start probe with and without it,
# on cold and then warm on-disk caches.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
S=$SECONDS
echo "triton cache entries at start: $(ls ~/.triton/cache 2>/dev/null | wc -l)"
WARM=1 timeout 200 python3 .dev/cold_start.py w1 2>&1 | grep "^\[" ; echo "w1 at $((SECONDS - S)) s"
WARM=1 timeout 200 python3 .dev/cold_start.py w2 2>&1 | grep "^\[" ; echo "w2 at $((SECONDS - S)) s"
timeout 200 python3 .dev/cold_start.py nw2 2>&1 | grep "^\[" ; echo "nw2 at $((SECONDS - S)) s"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_warm_up.py > $OUT/gpu_test_warm_up.txt 2>&1; tail -3 $OUT/gpu_test_warm_up.txt
echo "done at $((SECONDS - S)) s"
