#!/usr/bin/env bash
# `make test-sglang` / `make test-vllm`: the engine's own code drives pdxfer (tests/engines/).
#
# Builds .cache/venv-ENGINE from tests/engines/ENGINE-pins.txt with --no-deps (the engines'
# declared dependencies pull CUDA builds and GBs nobody needs to run their scheduler code on
# a CPU), installs this checkout into it (editable: the entry points SGLang and vLLM discover
# come from pyproject.toml), and runs tests/engines/test_ENGINE*.py in it. The venv is rebuilt
# only when the pins or pyproject.toml change. A build takes about a minute
# (docs/integration-engines.md has the figures): what the checkout's .venv holds at a pinned
# version is hard-linked, not installed again; pip fetches the rest without byte-compiling,
# and compileall compiles on every core. Each phase's time is in .cache/venv-ENGINE.log.
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
    phase() { echo "== $(( $(date +%s) - start )) s: $*" >>"$log"; }  # the build's phases, timed
    # No pip in the venv (ensurepip is seconds): this Python's pip installs into it (--python,
    # pip >= 22.3), or the venv gets its own where that pip is missing or older.
    "$python" -m venv --without-pip "$venv" >"$log" 2>&1 || skip "cannot create a venv with $python (see $log)"
    pip=("$python" -m pip --python "$venv/bin/python")
    if ! "${pip[@]}" --version >>"$log" 2>&1; then
        "$venv/bin/python" -m ensurepip -q >>"$log" 2>&1 || skip "no pip for $venv (see $log)"
        pip=("$venv/bin/python" -m pip)
    fi
    phase "venv created"
    # What make setup's .venv already holds at the pinned version (torch above all) is linked,
    # not unpacked and compiled again; pip installs the rest (tests/engines/reuse_installed.py).
    if [ -x .venv/bin/python ]; then
        .venv/bin/python tests/engines/reuse_installed.py "$pins" "$venv/bin/python" >>"$log" 2>&1 \
            || echo "nothing reused from .venv (see $log): pip installs every pin" >>"$log"
    fi
    phase "reused from .venv"
    # --no-compile, then compileall on every core: pip byte-compiles file by file, on one.
    if ! "${pip[@]}" install -q --no-deps --no-compile -r "$pins" >>"$log" 2>&1; then
        skip "the packages pinned in $pins cannot be installed here: $(grep -m2 -E '^ERROR' "$log" | tr '\n' ' ')(full log: $log)"
    fi
    phase "pins installed"
    # Editable, so the tests run this checkout; no build isolation: setuptools is pinned.
    if ! "${pip[@]}" install -q --no-deps --no-compile --no-build-isolation -e . >>"$log" 2>&1; then
        echo "FAILED make test-$engine: pdxfer did not install into $venv (see $log)"
        exit 1
    fi
    phase "pdxfer installed"
    # Byte code now, not at each import: with PYTHONDONTWRITEBYTECODE set, every process
    # importing the engine would compile it again (a dozen seconds each). Errors: files
    # that are not Python 3 (templates, test data), as pip's own compile ignores them.
    "$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1
    phase "byte-compiled"
    touch "$venv/.pdxfer-$key"
    echo "$engine venv built in $(( $(date +%s) - start )) s, $(du -sh "$venv" | cut -f1) ($venv)"
fi
# -P: the checkout is not put on sys.path, so the installed pdxfer (and the entry points in its
# metadata) is what the engine finds, as in a deployment.
# --confcutdir: tests/conftest.py (the main suite's) is not loaded; pytest would put tests/ on
# sys.path for it, and tests/pdxfer/ would then shadow the installed pdxfer as a namespace package.
exec "$venv/bin/python" -P -m pytest -q -p no:cacheprovider --confcutdir=tests/engines \
    tests/engines/test_"$engine"_*.py "$@"
