"""Engine tests run in the engine's own pinned venv (`make test-sglang`, `make test-vllm`).

`make test`'s venv has neither engine, so there these files are not
collected at all (rather than collected and skipped): they run, or they are
not part of that suite. tests/integrations/ holds what needs no engine.
"""

import importlib.util

collect_ignore_glob = [f"test_{engine}*.py" for engine in ("sglang", "vllm")
                       if importlib.util.find_spec(engine) is None]

if importlib.util.find_spec("vllm") is not None:
    # Before collection imports vLLM here: the fork server imports it alongside (vllm_forkserver).
    import vllm_forkserver

    vllm_forkserver.context()
