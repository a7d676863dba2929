#!/usr/bin/env bash
# Source this on the device machine (repo root): installs the carried wheels and stages the
# `taipan` package as the wheel lays it out, so `import taipan` works without pip-installing.
# .whl holds ../shared/device-wheels/*.whl and pytest-asyncio (the async GPU tests need it):
#   cp ../shared/device-wheels/*.whl .whl/ && pip download --no-deps -d .whl pytest-asyncio==1.5.0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
python3 -c "from tests.lint_imports import stage; from pathlib import Path; \
stage(Path('.'), Path('/tmp/pkg'))" || return 1
export PYTHONPATH=/tmp/pkg:/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
