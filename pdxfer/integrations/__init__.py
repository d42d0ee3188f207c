"""pdxfer as serving engines load it: an SGLang transfer backend and a vLLM KV connector.

Each module here is the small part that differs between engines, over the
shared kit in `kit.py` (the safe mapping of pdxfer's request states onto the
five an engine knows, pools built from the buffers an engine hands over, the
engine config read at the plugin edge):

- `pdxfer.integrations.sglang`: `PdxferKVManager`/`Sender`/`Receiver`/
  `BootstrapServer` and `register()`, the `sglang.srt.plugins` entry point
  that makes `--disaggregation-transfer-backend pdxfer` resolve to them;
- `pdxfer.integrations.vllm`: `PdxferConnector`, loaded by
  `kv_connector_module_path="pdxfer.integrations.vllm"` or by name through
  the `vllm.general_plugins` entry point `register()`.

The direction of dependencies: these modules import pdxfer and their engine;
pdxfer's core never imports them nor any engine (tests/test_dependency_direction.py).
Each imports its engine under a guard, so it imports — and its pure pieces
are unit-tested — where the engine is not installed; constructing a class
that needs the engine then says which package to install.
"""
