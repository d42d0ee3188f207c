# Two entry points, both from a fresh clone: `make demo` and `make test`.
# The venv is rebuilt only when pyproject.toml or setup.py changes (the stamp file).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pdxfer-installed

# torch is pinned here, not in pyproject: 2.13.0 is the CPU build on these
# machines' local disk, while an unpinned torch pulls a multi-GB CUDA build.
# It is installed first so nixl-cu12 (which asks for any torch) finds it
# satisfied instead of pulling a CUDA build of its own. setuptools is raised to what
# pyproject's build-system asks: the suite builds the wheel with --no-build-isolation
# (tests/test_wheel_install.py, docs/integration-engines.md), which uses the venv's own,
# and Python 3.11's venv ships 65.5, which refuses the SPDX `license = "MIT"`.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup demo test test-sglang test-vllm lint bench clean pyverbs gpu-check

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip "setuptools>=77"
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[test,nixl,plot,ucx]"
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(PY) -m examples.launch_pd --transport tcp --requests 8 --prompt-len 48 --gen-len 8

# Three pytest-xdist workers on two cores: much of the suite waits (timeouts waited out in
# real time, peers' replies, worker processes starting), so a third worker fills those
# waits; with two, a quarter of the cores' time went idle (docs/reliability.md, "Suite
# time", has both runs). Tests sharing one launcher run find it across workers
# (tests/conftest.py). Work stealing with the slowest files first (tests/conftest.py,
# tests/durations.json): the run ends on short tests, not on one worker's last long one.
# TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 3
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) $(if $(filter 0,$(TEST_WORKERS)),,--dist worksteal)

# SGLang's and vLLM's own code driving pdxfer (tests/engines/): each builds its own pinned
# venv under .cache/ on first use (minutes; then cached), and skips with the reason where
# the pins cannot be installed, except under CI=true.
test-sglang:
	tests/engines/run.sh sglang

test-vllm:
	tests/engines/run.sh vllm

# Real pyverbs for the fabric's honesty tests, unpacked under .cache/ (never installed
# system-wide); the tests fetch it themselves too, this only does it ahead of time.
pyverbs: setup
	$(PY) tests/transport/pyverbs_prefix.py

# The prepared GPU check (examples/gpu_check.py): a few minutes on one GPU, no NIC
# needed; JSON + markdown + UCX logs land in GPU_CHECK_OUT. Refuses without CUDA.
# Not tied to `setup`: that venv pins the CPU torch. On a GPU machine use an
# environment whose torch has CUDA, with pdxfer installed in it (pip install -e .
# --no-deps; nixl-cu12 for the nixl section): make gpu-check GPU_PY=python3
GPU_CHECK_OUT ?= docs/gpu-check
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
gpu-check:
	$(GPU_PY) -m examples.gpu_check --out $(GPU_CHECK_OUT)

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(VENV)/bin/pdxfer bench transport
	$(VENV)/bin/pdxfer bench engine
	$(VENV)/bin/pdxfer bench layouts --plot docs/img/layouts.png

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
