#!/usr/bin/env bash
# The project's own tests: tests/ (unit tests, real multi-rank gloo runs, and the smoke
# suite end to end). Same set-up as run_all.sh. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")"
./run_all.sh --setup-only
exec .venv/bin/python -m pytest tests/ "$@"
