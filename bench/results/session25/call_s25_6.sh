#!/bin/bash
# Session 25, call 6: the step's GEMMs through cuBLASLt's heuristic against cuBLAS's.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
timeout 300 python3 .dev/blas_ab.py $OUT/blas_ab.json 2>&1 | grep -v -i warn | tee $OUT/blas_ab.txt
