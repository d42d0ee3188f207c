"""What the SGLang-adapter test and its prefill process share: seeded pools and page checksums."""

from __future__ import annotations

import zlib

import torch

from examples import sglang_adapter as sa


def seeded_pools(num_pages: int, num_slots: int, seed: int) -> dict[str, dict]:
    """SGLang-shaped tensors filled with values from `seed` (never NaN, so == is exact)."""
    pools = sa.allocate_pools(num_pages, num_slots)
    gen = torch.Generator().manual_seed(seed)
    for group in pools.values():
        for tensors in group.values():
            for t in tensors:
                t.copy_(torch.randint(-512, 512, t.shape, generator=gen).to(t.dtype))
    return pools


def checksum(pools: dict[str, dict], pages: list[int], slot: int) -> int:
    """crc32 of the request's pages in every K/V tensor, then its slot in every state tensor."""
    crc = 0
    for tensors in pools["kv"].values():
        for t in tensors:
            paged = t.view(-1, sa.PAGE_SIZE, *t.shape[1:])
            crc = zlib.crc32(paged[torch.as_tensor(pages)].contiguous().view(torch.uint8).numpy(), crc)
    for tensors in pools["state"].values():
        for t in tensors:
            crc = zlib.crc32(t[slot].contiguous().view(torch.uint8).numpy(), crc)
    return crc
