#!/usr/bin/env bash
# The project's own tests: ruff and mypy first (so a lint or type error fails CI before the
# 12-minute suite starts), then tests/ (unit tests, real multi-rank gloo runs, and the smoke
# suite end to end). Same set-up as run_all.sh. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
./run_all.sh --setup-only
.venv/bin/ruff check harness suites tests
.venv/bin/mypy  # what and how strictly: [tool.mypy] in pyproject.toml
exec .venv/bin/python -m pytest tests/ "$@"
