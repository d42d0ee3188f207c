#!/usr/bin/env bash
# `make test-sglang` / `make test-vllm`: the engine's own code drives pdxfer (tests/engines/).
#
# Builds .cache/venv-ENGINE from tests/engines/ENGINE-pins.txt with --no-deps (the engines'
# declared dependencies pull CUDA builds and GBs nobody needs to run their scheduler code on
# a CPU), installs this checkout into it (editable: the entry points SGLang and vLLM discover
# come from pyproject.toml), and runs tests/engines/test_ENGINE*.py in it. The venv is rebuilt
# only when the pins or pyproject.toml change; pip's own cache makes a rebuild, or a fresh
# clone's first build, a reinstall from local wheels.
#
# Where the pinned packages cannot be installed (no index, no CPU torch wheel), this prints
# why and exits 0 ("SKIPPED"), except under CI=true, where it fails: CI must run them.
set -uo pipefail
engine="${1:?usage: run.sh sglang|vllm [pytest args]}"
shift
cd "$(dirname "$0")/../.."
pins="tests/engines/$engine-pins.txt"
venv=".cache/venv-$engine"
log=".cache/venv-$engine.log"
key=$(cat "$pins" pyproject.toml | sha256sum | cut -c1-16)
python="${PYTHON:-python3}"

skip() {
    if [ "${CI:-}" = "true" ]; then
        echo "FAILED make test-$engine: $1 (CI=true: the engine tests may not be skipped)"
        exit 1
    fi
    echo "SKIPPED make test-$engine: $1"
    exit 0
}

if [ ! -f "$venv/.pdxfer-$key" ]; then
    mkdir -p .cache
    rm -rf "$venv"
    start=$(date +%s)
    "$python" -m venv "$venv" >"$log" 2>&1 || skip "cannot create a venv with $python (see $log)"
    if ! "$venv/bin/pip" install -q --no-deps -r "$pins" >>"$log" 2>&1; then
        skip "the packages pinned in $pins cannot be installed here: $(grep -m2 -E '^ERROR' "$log" | tr '\n' ' ')(full log: $log)"
    fi
    # Editable, so the tests run this checkout; no build isolation: setuptools is pinned.
    if ! "$venv/bin/pip" install -q --no-deps --no-build-isolation -e . >>"$log" 2>&1; then
        echo "FAILED make test-$engine: pdxfer did not install into $venv (see $log)"
        exit 1
    fi
    touch "$venv/.pdxfer-$key"
    echo "$engine venv built in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1) ($venv)"
fi
# -P: the checkout is not put on sys.path, so the installed pdxfer (and the entry points in its
# metadata) is what the engine finds, as in a deployment.
# --confcutdir: tests/conftest.py (the main suite's) is not loaded; pytest would put tests/ on
# sys.path for it, and tests/pdxfer/ would then shadow the installed pdxfer as a namespace package.
exec "$venv/bin/python" -P -m pytest -q -p no:cacheprovider --confcutdir=tests/engines \
    tests/engines/test_"$engine"_*.py "$@"
