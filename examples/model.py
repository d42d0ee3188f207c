"""A small deterministic hybrid model whose caches are pdxfer arenas.

The model exists to give the PD example real caches of every kind a hybrid
serving stack ships, produced and consumed by real arithmetic, so the launcher
can check the disaggregated run against a single-process one token for token:

- two paged MHA layers, K/V written into and gathered from the ``kv`` pages;
- a GDN/Mamba-style recurrent layer: a causal depthwise conv whose window lives
  in the request's ``state`` entry, and a gated outer-product temporal state;
- a DeepSeek-V4-style compressor: a ring of `kv_state`/`score_state` rows per
  request, pooled by a softmax over the ring. A new window resets the scores
  to the declared `-inf` fill, so slots not yet written contribute exactly 0.

Every cache byte is read and written through `arena.view(name)`; the model has
no cache tensor of its own, which is what makes "ship the arenas" sufficient.

Determinism is the point, so: float32 arithmetic (K/V are stored as FP8 with
per-page scales, see `write_fp8`, and dequantised before any matmul), weights
drawn from a fixed seed by a CPU generator (no download, identical on every
machine), greedy argmax, and a prefill and a decode step that run the same
kernels on the same shapes whichever process calls them. Page *indices* differ
between processes, but the model only ever gathers pages into a dense
`[tokens, heads, dim]` tensor before computing, so indices never reach the arithmetic.
`deterministic_torch()` pins intra-op threads to one, because a reduction split
differently across threads is free to round differently.

Deliberately absent: batching, RoPE, any serving-grade kernel. Batching is
what would make the shapes differ between the reference and the workers.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from collections.abc import Callable

    from .caches import ModelCaches


@dataclass(frozen=True)
class ModelConfig:
    """Every dimension of the toy model; both workers and the reference share it."""

    vocab: int = 96
    dim: int = 32
    heads: int = 2
    head_dim: int = 16
    attn_layers: int = 2
    page_size: int = 4
    conv_width: int = 4
    rec_heads: int = 2
    rec_dk: int = 16
    rec_dv: int = 16
    # Not a divisor of the demo's prompt lengths on purpose: the ring then
    # crosses the prefill -> decode boundary half full, `-inf` slots included.
    ring: int = 5
    comp_dim: int = 32
    seed: int = 20240607


# What one prefill's attention scores may take: `_attention` holds a dense
# [heads, prompt, prompt] float32 score matrix (no flash kernel in a toy), so
# the prompt length, not the pools, is what runs a machine out of memory: a
# 100,000-token prompt would ask for 80 GB. The launchers refuse past this.
SCORES_BUDGET_BYTES = 512 << 20


def scores_bytes(cfg: ModelConfig, tokens: int) -> int:
    """Bytes of the attention score matrix a forward over `tokens` positions holds."""
    return cfg.heads * tokens * tokens * 4


def max_context(cfg: ModelConfig) -> int:
    """The most positions (prompt + generated) whose scores fit `SCORES_BUDGET_BYTES`."""
    return math.isqrt(SCORES_BUDGET_BYTES // (cfg.heads * 4))


def check_context(cfg: ModelConfig, prompt_len: int, gen_len: int) -> str | None:
    """Why `prompt_len + gen_len` positions are too many for the toy model, or None."""
    limit = max_context(cfg)
    if prompt_len + gen_len <= limit:
        return None
    return (f"{prompt_len:,} prompt + {gen_len:,} generated tokens are over the toy model's "
            f"{limit:,} positions: its attention holds a dense {cfg.heads} x n x n float32 "
            f"score matrix ({scores_bytes(cfg, prompt_len) / 1e9:.1f} GB for this prompt, "
            f"the limit is {SCORES_BUDGET_BYTES >> 20} MiB)")


def deterministic_torch() -> None:
    """One intra-op thread, so every process reduces in the same order."""
    torch.set_num_threads(1)


def _init_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg.seed)

    def w(*shape: int, scale: float | None = None) -> torch.Tensor:
        fan_in = shape[0]
        return torch.randn(*shape, generator=gen) * (scale or fan_in**-0.5)

    d, hd = cfg.dim, cfg.heads * cfg.head_dim
    params = {"embed": w(cfg.vocab, d, scale=1.0)}
    for a in range(cfg.attn_layers):
        params |= {
            f"attn{a}.wq": w(d, hd),
            f"attn{a}.wk": w(d, hd),
            f"attn{a}.wv": w(d, hd),
            f"attn{a}.wo": w(hd, d),
        }
    params |= {
        "rec.w_in": w(d, d),
        "rec.conv": w(cfg.conv_width, d, scale=0.5),
        "rec.wq": w(d, cfg.rec_heads * cfg.rec_dk),
        "rec.wk": w(d, cfg.rec_heads * cfg.rec_dk),
        "rec.wv": w(d, cfg.rec_heads * cfg.rec_dv),
        "rec.wg": w(d, cfg.rec_heads),
        "rec.wo": w(cfg.rec_heads * cfg.rec_dv, d),
        "comp.wkv": w(d, cfg.comp_dim),
        "comp.wscore": w(d, cfg.comp_dim, scale=2.0 * d**-0.5),
        "comp.wo": w(cfg.comp_dim, d),
        "lm_head": w(d, cfg.vocab),
    }
    return params


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


# -- FP8 K/V with per-page scales ------------------------------------------------
# K and V live in the kv pages as float8_e4m3fn, each (page, layer, KV head)
# with its float32 scale stored as a field of the same page entry, so a page
# ships its scales in the same byte range (and, layer-interleaved, each layer's
# scales inside that layer's range; shard-major, each rank's heads' scales with
# its heads). A dequantised value is `fp8 * scale`.
#
# The rule, identical in every process and independent of how a sequence is
# split between prefill and decode steps: a page's scale is fixed when its
# FIRST token (slot 0) is written, as that token's amax (per head, over
# head_dim) x `FP8_HEADROOM` / 448, floored at `FP8_SCALE_FLOOR`; every later
# token of the page, from the same prefill or from a decode step, is quantised
# with it, clamped to +-448, and the page is never requantised (that would
# rewrite bytes the other side already holds).
# Trade-off, chosen on purpose: a scale over all of a page's prefill tokens
# would fit them tighter, but the page's bytes would then depend on where the
# prompt ended (a page the prefill fills half and decode completes would differ
# from the same tokens prefilled whole), so decoding from the caches would no
# longer equal re-running the longer prompt (tests/examples/test_model.py pins
# that). The first-token rule costs headroom instead: a later token above
# `FP8_HEADROOM` x the first one saturates. e4m3's relative precision is the
# same across its normal range, so the headroom only gives up range at the
# bottom. vLLM keeps one scale per layer and ships no dynamic scale at all;
# here the scale is page data and travels with the page.
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
FP8_SCALE_FLOOR = 1e-12  # a page opened by an all-zero token still gets a finite, non-zero scale
FP8_HEADROOM = 4.0  # later tokens of a page may be this much larger than its first unclipped


def write_fp8(pages: torch.Tensor, scales: torch.Tensor, page_ids: torch.Tensor,
              start: int, x: torch.Tensor) -> None:
    """Quantise `x` ([T, H, D], positions `start..start+T`) into `pages` ([P, ps, H, D]
    float8) under the rule above, first setting the scales ([P, H]) of the pages
    whose first token is among them."""
    T, ps = x.shape[0], pages.shape[1]
    pos = torch.arange(start, start + T, device=x.device)
    where = page_ids[pos // ps]
    opens = pos % ps == 0
    # amax is exact, so quantising one head alone (TP) gives the same bytes.
    first = x[opens].abs().amax(-1)  # [opened pages, H]
    scales[where[opens]] = (first * (FP8_HEADROOM / FP8_MAX)).clamp_min(FP8_SCALE_FLOOR)
    q = (x / scales[where][..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    pages[where, pos % ps] = q


def read_fp8(pages: torch.Tensor, scales: torch.Tensor, page_ids: torch.Tensor,
             n: int) -> torch.Tensor:
    """The first `n` positions of `page_ids` dequantised to float32 `[n, H, D]`."""
    ps = pages.shape[1]
    used = page_ids[: -(-n // ps)]
    rows = pages[used].to(torch.float32) * scales[used][:, None, :, None]
    return rows.reshape(-1, *pages.shape[2:])[:n]


class HybridModel:
    """Weights plus the forward pass; the caches are passed in, never owned."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.p = {k: v.to(self.device) for k, v in _init_weights(cfg).items()}

    def digest(self) -> str:
        """Hash of config and weights: two workers serve the same model iff equal."""
        h = hashlib.sha256(repr(sorted(asdict(self.cfg).items())).encode())
        for name in sorted(self.p):
            h.update(name.encode())
            h.update(self.p[name].cpu().numpy().tobytes())
        return h.hexdigest()[:16]

    # -- the two entry points -------------------------------------------------
    @torch.no_grad()
    def prefill(
        self, caches: ModelCaches, prompt: list[int], pages: np.ndarray,
        state_entry: int, aux_entry: int, on_layer: Callable[[int], None] | None = None,
    ) -> int:
        """Run the prompt, leaving its K/V in `pages`, its recurrent and
        compressor state in `state_entry` and its first token in `aux_entry`.

        `on_layer(l)`: called once attention layer `l`'s K/V pages are final
        (a prefill streaming layer groups sends them from there)."""
        caches.reset_state(state_entry)
        tokens = torch.as_tensor(prompt, dtype=torch.int64, device=self.device)
        token = self._forward(caches, tokens, start=0, pages=pages, entry=state_entry,
                              on_layer=on_layer)
        caches.pools["aux"].view("first_token")[0, aux_entry, 0] = token
        return token

    @torch.no_grad()
    def decode(
        self, caches: ModelCaches, prompt_len: int, gen_len: int, pages: np.ndarray,
        state_entry: int, aux_entry: int,
    ) -> list[int]:
        """`gen_len` tokens continuing a prefilled request, one step at a time.

        The first is the one prefill sampled (read from `aux_entry`); each
        later one is a single-token forward over the caches.
        """
        token = int(caches.pools["aux"].view("first_token")[0, aux_entry, 0])
        out = [token]
        for pos in range(prompt_len, prompt_len + gen_len - 1):
            tokens = torch.tensor([token], dtype=torch.int64, device=self.device)
            token = self._forward(caches, tokens, start=pos, pages=pages, entry=state_entry)
            out.append(token)
        return out

    # -- layers ---------------------------------------------------------------
    def _forward(
        self, caches: ModelCaches, tokens: torch.Tensor, start: int,
        pages: np.ndarray, entry: int, on_layer: Callable[[int], None] | None = None,
    ) -> int:
        page_ids = torch.as_tensor(pages, dtype=torch.int64, device=self.device)
        x = self.p["embed"][tokens]
        x = x + self._attention(caches, 0, _rms(x), start, page_ids)
        if on_layer is not None:
            on_layer(0)
        x = x + self._recurrent(caches, _rms(x), entry)
        x = x + self._attention(caches, 1, _rms(x), start, page_ids)
        if on_layer is not None:
            on_layer(1)
        x = x + self._compressor(caches, _rms(x), start, entry)
        logits = _rms(x[-1:]) @ self.p["lm_head"]
        return int(torch.argmax(logits[0]))

    def _attention(
        self, caches: ModelCaches, layer: int, h: torch.Tensor, start: int,
        page_ids: torch.Tensor,
    ) -> torch.Tensor:
        cfg, p, T = self.cfg, self.p, h.shape[0]
        H, D = cfg.heads, cfg.head_dim
        q = (h @ p[f"attn{layer}.wq"]).view(T, H, D)
        k = (h @ p[f"attn{layer}.wk"]).view(T, H, D)
        v = (h @ p[f"attn{layer}.wv"]).view(T, H, D)
        pool = caches.pools["kv"]
        # [pages, page_size, H, D] float8 and [pages, H] float32 scales.
        k_pages, v_pages = pool.view("k")[layer], pool.view("v")[layer]
        k_scale, v_scale = pool.view("kv_scale")[layer].unbind(1)
        pos = torch.arange(start, start + T, device=self.device)
        write_fp8(k_pages, k_scale, page_ids, start, k)
        write_fp8(v_pages, v_scale, page_ids, start, v)
        n = start + T
        # Gather to dense rows first: from here on no page index is involved.
        keys = read_fp8(k_pages, k_scale, page_ids, n)
        vals = read_fp8(v_pages, v_scale, page_ids, n)
        scores = torch.einsum("thd,nhd->htn", q, keys) * D**-0.5
        future = torch.arange(n, device=self.device)[None, :] > pos[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        out = torch.einsum("htn,nhd->thd", torch.softmax(scores, dim=-1), vals)
        return out.reshape(T, H * D) @ p[f"attn{layer}.wo"]

    def _recurrent(self, caches: ModelCaches, h: torch.Tensor, entry: int) -> torch.Tensor:
        cfg, p, T = self.cfg, self.p, h.shape[0]
        pool = caches.pools["state"]
        window = pool.view("conv")[0, entry]  # [conv_width - 1, dim]
        state = pool.view("temporal")[0, entry]  # [heads, dk, dv]
        u = h @ p["rec.w_in"]
        padded = torch.cat([window, u])
        conv = (padded.unfold(0, cfg.conv_width, 1) * p["rec.conv"].T).sum(-1)
        window.copy_(padded[-(cfg.conv_width - 1):])
        c = F.silu(conv)
        q = (c @ p["rec.wq"]).view(T, cfg.rec_heads, cfg.rec_dk)
        k = F.normalize((c @ p["rec.wk"]).view(T, cfg.rec_heads, cfg.rec_dk), dim=-1)
        v = (c @ p["rec.wv"]).view(T, cfg.rec_heads, cfg.rec_dv)
        decay = torch.sigmoid(c @ p["rec.wg"])  # [T, heads]
        s = state.clone()
        outs = []
        for t in range(T):
            s = decay[t, :, None, None] * s + k[t, :, :, None] * v[t, :, None, :]
            outs.append(torch.einsum("hk,hkv->hv", q[t], s))
        state.copy_(s)
        return torch.stack(outs).reshape(T, -1) @ p["rec.wo"]

    def _compressor(
        self, caches: ModelCaches, h: torch.Tensor, start: int, entry: int,
    ) -> torch.Tensor:
        cfg, p = self.cfg, self.p
        pool = caches.pools["state"]
        kv_state = pool.view("kv_state")[0, entry]  # [ring, comp_dim]
        score_state = pool.view("score_state")[0, entry]
        kvs = h @ p["comp.wkv"]
        scores = h @ p["comp.wscore"]
        outs = []
        for t in range(h.shape[0]):
            slot = (start + t) % cfg.ring
            if slot == 0:
                # A new window: last window's rows go back to the declared
                # fills, so slots this window has not reached lose the softmax.
                caches.reset_fields(entry, ("kv_state", "score_state"))
            kv_state[slot] = kvs[t]
            score_state[slot] = scores[t]
            weights = torch.softmax(score_state, dim=0)  # -inf rows weigh exactly 0
            outs.append((weights * kv_state).sum(0))
        return torch.stack(outs) @ p["comp.wo"]
