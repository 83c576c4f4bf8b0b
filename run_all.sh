#!/usr/bin/env bash
# shardbench: set up .venv on first use, then run a suite through pytest.
#
#   ./run_all.sh                          the default suite on this machine's hardware
#   ./run_all.sh --gpus 8 -m "fsdp and bf16"
#   ./run_all.sh --suite smoke --out /tmp/sb
#   ./run_all.sh --setup-only             only create/refresh .venv
#   SHARDBENCH_WHEELHOUSE=wheels ./run_all.sh --gpus 1 ...
#                                         a node without a package index: install from wheels
#
# Every other argument goes to `python -m harness run` (see --help there).
set -euo pipefail
# A wheelhouse named relative to where the command was typed, not to the repository.
if [ -n "${SHARDBENCH_WHEELHOUSE:-}" ]; then
    SHARDBENCH_WHEELHOUSE=$(realpath -m -- "$SHARDBENCH_WHEELHOUSE")
fi
cd "$(dirname "$0")"

VENV=.venv
TORCH_CPU_PIN=torch==2.13.0

bootstrap() {
    # A node that reaches no package index (an air-gapped cluster) installs from a folder of
    # wheels made where one is reachable (README: "A node without a package index"): the
    # engines only, over what its image has; the project's own tests do not run there.
    local index=() extras="engines,test"
    if [ -n "${SHARDBENCH_WHEELHOUSE:-}" ]; then
        if [ ! -d "$SHARDBENCH_WHEELHOUSE" ]; then
            echo "shardbench: error: SHARDBENCH_WHEELHOUSE=$SHARDBENCH_WHEELHOUSE: no such folder" >&2
            exit 2
        fi
        index=(--no-index --find-links "$SHARDBENCH_WHEELHOUSE")
        extras="engines"
    fi
    # Re-install only when pyproject.toml or the extras changed since the last set-up.
    local stamp="$VENV/.installed-$(sha1sum pyproject.toml | cut -c1-12)-${extras/,/-}"
    [ -f "$stamp" ] && return 0
    if [ ! -x "$VENV/bin/python" ]; then
        if python3 -c "import torch" 2>/dev/null; then
            # A GPU image ships its own CUDA build of torch: keep it, never replace it.
            echo "shardbench: keeping the torch this machine has ($(python3 -c 'import torch; print(torch.__version__)'))"
            python3 -m venv --system-site-packages "$VENV"
        else
            python3 -m venv "$VENV"
        fi
    fi
    if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
        # Pinned on purpose: an open range with no torch present pulls a multi-GB CUDA build.
        echo "shardbench: installing $TORCH_CPU_PIN (CPU) into $VENV"
        "$VENV/bin/pip" install --quiet "${index[@]}" "$TORCH_CPU_PIN"
    fi
    echo "shardbench: installing shardbench and its dependencies into $VENV"
    # Hold torch at the version in the venv, so no dependency can swap an image's own CUDA
    # build (or a pre-release such as 2.6.0a0) for a PyPI one.
    local constraints="$VENV/torch-constraint.txt"
    "$VENV/bin/python" -W ignore -c "import torch; print('torch==' + torch.__version__)" > "$constraints"
    # --no-build-isolation: deepspeed imports torch while it builds. That makes this venv's
    # own setuptools build shardbench too, so bring it up to what pyproject.toml asks.
    "$VENV/bin/pip" install --quiet "${index[@]}" -c "$constraints" "setuptools>=68" wheel
    "$VENV/bin/pip" install --quiet "${index[@]}" -c "$constraints" --no-build-isolation -e ".[$extras]"
    # DeepSpeed compiles its ops on first use; build them now rather than inside a run's first
    # cells (harness/strategies/deepspeed_zero.py, build_ops).
    echo "shardbench: building DeepSpeed's ops for $VENV (a few minutes, once)"
    "$VENV/bin/python" -W ignore -c "from harness import distributed; from harness.strategies import deepspeed_zero
deepspeed_zero.build_ops(distributed.selected_device())"
    rm -f "$VENV"/.installed-*
    touch "$stamp"
}

compile_package() {
    # Every rank of every launch imports the package. Where the environment says not to write
    # bytecode (PYTHONDONTWRITEBYTECODE, as this project's development hosts do), each of those
    # processes would compile it again (~0.3 s of CPU each, hundreds of them in the tests):
    # compiled once here instead; an edit since is compiled by the next run's call.
    "$VENV/bin/python" -m compileall -q harness > /dev/null
}

usage() {
    cat <<'USAGE'
usage: ./run_all.sh [--setup-only | --help | RUN OPTIONS...]

  --setup-only   create or refresh .venv (torch, the engines, DeepSpeed's ops) and stop
  --help, -h     this help, then `python -m harness run --help` where .venv exists
  RUN OPTIONS    anything else goes to `python -m harness run` (its own flags, then pytest's)

Before a run, the set-up runs again only when pyproject.toml has changed since the last one,
or SHARDBENCH_WHEELHOUSE (a folder of wheels for a node without a package index) was set or unset.
USAGE
}

case "${1:-}" in
    --setup-only)
        bootstrap
        compile_package
        exit 0
        ;;
    -h|--help)
        usage
        if [ -x "$VENV/bin/python" ]; then
            echo
            exec "$VENV/bin/python" -m harness run --help
        fi
        echo "(run ./run_all.sh --setup-only first to see the run options)"
        exit 0
        ;;
esac
bootstrap
compile_package
exec "$VENV/bin/python" -m harness run "$@"
