"""The toy model split over tensor-parallel ranks, and its shard-major caches.

Rank r of a TP group of size t holds heads `[r*H/t, (r+1)*H/t)` of each
attention layer: their Q/K/V projection columns, their K/V pages (a
`ShardMajorArena`, so its heads of every layer of a page are one byte range)
and their rows of the output projection. The recurrent and compressor layers
and the first token are replicated: every rank computes them, every rank's
state/aux pools hold them whole.

Bit-for-bit equality with the monolithic run is by construction, not luck:
every attention head is computed on its own (projection, scores, output, its
slice of the output projection) with the same shapes whatever the TP size,
and the per-head partials are all-gathered and summed in head order — so TP=1
in one process (the reference) and TP=t across t processes add the same
numbers in the same order. The collective is `torch.distributed` over gloo
with a FileStore rendezvous (no port to race for); TP=1 needs none.

`--replicated` (MLA-style) declares the K/V fields with no TP axis: every rank
writes and holds every head's K/V (as MLA's latent KV is replicated across
ranks) while still computing attention for its own heads only; the transfer
then ships whole pages from one chosen prefill rank to each decode rank.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from pdxfer.layout import ShardMajorArena

from .caches import POOLS, EntryAllocator, ModelCaches, PoolSizes, pool_fields
from .model import HybridModel, ModelConfig, read_fp8, write_fp8

# Eight heads so TP sizes 1, 2, 4 and 8 all divide them; same width as the
# default model (heads * head_dim == 32).
TP_CONFIG = ModelConfig(heads=8, head_dim=4)


def tp_pool_fields(cfg: ModelConfig, replicated_kv: bool) -> dict:
    """The example's field lists with K/V split on the head axis (unless replicated)."""
    fields = pool_fields(cfg)
    if not replicated_kv:
        # K/V are (page, heads, dim), their scales (2, heads): each rank's scales go with its heads.
        fields["kv"] = [replace(f, tp_axis=1) for f in fields["kv"]]
    return fields


class TPCaches(ModelCaches):
    """`ModelCaches` whose arenas are one rank's shard-major part."""

    def __init__(self, cfg: ModelConfig, sizes: PoolSizes, device: torch.device, *,
                 tp: int, rank: int, replicated_kv: bool) -> None:
        fields = tp_pool_fields(cfg, replicated_kv)
        counts = sizes.entries()
        self.cfg = cfg
        self.pools = {name: ShardMajorArena(fields[name], counts[name], device, tp=tp, rank=rank)
                      for name in POOLS}
        self.allocators = {name: EntryAllocator(name, counts[name], f"--{name}")
                           for name in POOLS}


class TPModel(HybridModel):
    """`HybridModel` with attention over this rank's heads and a head-ordered sum."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str, *, tp: int = 1,
                 rank: int = 0, replicated_kv: bool = False, group: object = None) -> None:
        super().__init__(cfg, device)
        per = cfg.heads // tp
        self.heads = range(rank * per, (rank + 1) * per)
        self.tp, self.replicated_kv, self.group = tp, replicated_kv, group

    def _attention(self, caches: ModelCaches, layer: int, h: torch.Tensor, start: int,
                   page_ids: torch.Tensor) -> torch.Tensor:
        cfg, p, T = self.cfg, self.p, h.shape[0]
        D = cfg.head_dim
        pool = caches.pools["kv"]
        # [pages, page_size, local heads, D] float8 and [pages, local heads] scales, strided by head.
        k_pages, v_pages = pool.view("k")[layer], pool.view("v")[layer]
        k_scale, v_scale = pool.view("kv_scale")[layer].unbind(1)
        pos = torch.arange(start, start + T, device=self.device)
        n = start + T
        future = torch.arange(n, device=self.device)[None, :] > pos[:, None]
        cols = lambda w, head: p[w][:, head * D:(head + 1) * D]  # noqa: E731
        one = lambda t, j: t[..., j:j + 1]  # noqa: E731  (head j's scales, a view)
        # Which heads this rank's pages hold, and at which local index. A scale
        # is per head, so quantising one head alone gives the monolithic bytes.
        stored = range(cfg.heads) if self.replicated_kv else self.heads
        for j, head in enumerate(stored):
            k = (h @ cols(f"attn{layer}.wk", head))[:, None, :]
            v = (h @ cols(f"attn{layer}.wv", head))[:, None, :]
            write_fp8(k_pages[:, :, j:j + 1], one(k_scale, j), page_ids, start, k)
            write_fp8(v_pages[:, :, j:j + 1], one(v_scale, j), page_ids, start, v)
        partials = []
        for head in self.heads:
            j = head if self.replicated_kv else head - self.heads.start
            q = h @ cols(f"attn{layer}.wq", head)
            keys = read_fp8(k_pages[:, :, j:j + 1], one(k_scale, j), page_ids, n)[:, 0]
            vals = read_fp8(v_pages[:, :, j:j + 1], one(v_scale, j), page_ids, n)[:, 0]
            scores = (q @ keys.T * D**-0.5).masked_fill(future, float("-inf"))
            out = torch.softmax(scores, dim=-1) @ vals
            partials.append(out @ p[f"attn{layer}.wo"][head * D:(head + 1) * D])
        mine = torch.stack(partials)
        if self.tp > 1:
            gathered = [torch.empty_like(mine) for _ in range(self.tp)]
            dist.all_gather(gathered, mine, group=self.group)
            mine = torch.cat(gathered)
        total = mine[0]
        for part in mine[1:]:  # head order, whatever the TP size
            total = total + part
        return total


def tp_reference(prompt: list[int], gen_len: int, replicated_kv: bool) -> list[int]:
    """The monolithic run: the same model at TP=1 in this process, no transfer."""
    from .caches import decode_counts, prefill_counts

    cfg = TP_CONFIG
    model = TPModel(cfg, "cpu", replicated_kv=replicated_kv)
    need = decode_counts(cfg, len(prompt), gen_len)
    caches = TPCaches(cfg, PoolSizes(kv_pages=need["kv"], state_entries=1), model.device,
                      tp=1, rank=0, replicated_kv=replicated_kv)
    idx = caches.allocate(need)
    state, aux = int(idx["state"][0]), int(idx["aux"][0])
    pages = np.asarray(idx["kv"][: prefill_counts(cfg, len(prompt))["kv"]])
    model.prefill(caches, prompt, pages, state, aux)
    return model.decode(caches, len(prompt), gen_len, idx["kv"], state, aux)
