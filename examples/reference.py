"""The same model run in one process, without disaggregation: the oracle.

The launcher's "outputs identical" claim is a comparison against this. It
allocates exactly the entry counts a decode worker allocates, prefills into
the front of the pages (as many as a prefill worker would use), and decodes
from the same arenas, so every kernel sees the shapes the two workers see and
the only thing the disaggregated run adds is the transfer between them.
"""

from __future__ import annotations

import torch

from .caches import ModelCaches, PoolSizes, decode_counts, prefill_counts
from .model import HybridModel


def reference_generate(model: HybridModel, prompt: list[int], gen_len: int) -> list[int]:
    """`gen_len` greedy tokens for `prompt`, prefill and decode in this process."""
    cfg = model.cfg
    need = decode_counts(cfg, len(prompt), gen_len)
    caches = ModelCaches(cfg, PoolSizes(kv_pages=need["kv"], state_entries=1), model.device)
    idx = caches.allocate(need)
    state, aux = int(idx["state"][0]), int(idx["aux"][0])
    prompt_pages = idx["kv"][: prefill_counts(cfg, len(prompt))["kv"]]
    model.prefill(caches, prompt, prompt_pages, state, aux)
    return model.decode(caches, len(prompt), gen_len, idx["kv"], state, aux)


def resolve_device(name: str) -> torch.device:
    """`auto` is CUDA when present, else CPU; anything else is taken as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
