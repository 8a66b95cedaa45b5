"""Dense, cache-free forwards of `TinyHybrid` and `DecoderLM`: the oracles that paged and distributed runs
are tested against.

Both run the model's own modules (embedding, engram fusion, projections, rotation, MLP, norms) but store
no paged KV and call no paged kernel: attention is a plain masked softmax over explicit key lists, and the
engram hash is the PyTorch reference. They differ from the paged forward only in how keys are kept.

- `dense_forward`: a cold run over a whole sequence in one chunk.
- `replay_reference`: DESIGN section 4's truncated replay after a prefix hit of `hit_tokens` tokens,
  recomputing from `replay_start` on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raystate.kernels import engram_hash_ref
from raystate.model.decoder_lm import DecoderLM
from raystate.model.transformer import TinyHybrid

LayerKV = tuple[torch.Tensor, torch.Tensor]  # k, v: [L, H_kv, head_dim], position p at row p


def dense_attention(
    q: torch.Tensor,  # [Q, H, head_dim]
    k: torch.Tensor,  # [K, H_kv, head_dim]
    v: torch.Tensor,  # [K, H_kv, head_dim]
    q_pos: torch.Tensor,  # int64 [Q]
    k_pos: torch.Tensor,  # int64 [K]
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:  # [Q, H, head_dim], fp32 math
    """Causal (and windowed) softmax attention over explicit keys, by absolute position."""
    group = q.shape[1] // k.shape[1]
    keys = k.float().repeat_interleave(group, dim=1)  # [K, H, head_dim]
    vals = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), keys) * scale  # [H, Q, K]
    allowed = k_pos[None, :] <= q_pos[:, None]  # [Q, K]
    if sliding_window:
        allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
    probs = torch.softmax(scores.masked_fill(~allowed[None], float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vals).to(q.dtype)


def _as_ids(model: TinyHybrid | DecoderLM, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    device = model.lm_head.weight.device
    return torch.as_tensor(token_ids, dtype=torch.int64, device=device).reshape(-1)


def _truncated_forward(
    model: TinyHybrid | DecoderLM,
    ids: torch.Tensor,  # int64 [L]: the whole sequence
    start: int,  # compute positions [start, L)
    full_prefix_kv: list[LayerKV] | None,  # per layer; full layers read it for positions < prefix_len
    # (prefix_len >= start: positions below start are never computed here)
    prefix_len: int,
) -> tuple[torch.Tensor, list[LayerKV]]:
    """Logits fp32 [L - start, vocab] and each layer's K/V of positions [start, L)."""
    device = ids.device
    seq_len = ids.shape[0]
    chunk = ids[start:]
    positions = torch.arange(start, seq_len, device=device)  # int64 [Q]
    depth = max(model.token_lookback_depth, 1)
    before = start - 1 - torch.arange(depth, device=device)  # newest first
    lookback = torch.where(before >= 0, ids[before.clamp(min=0)], -1).to(torch.int32)[None, :]  # [1, D]
    qsl = torch.tensor([0, seq_len - start], dtype=torch.int32, device=device)
    hidden = model.embed_tokens(chunk)
    computed_kv: list[LayerKV] = []
    for layer in model.layers:
        if getattr(layer, "engram", None) is not None:
            e = layer.engram
            rows = engram_hash_ref(
                chunk, qsl, lookback, e.compress, e.multipliers, e.primes, e.offsets, e.pad_id
            )  # int64 [Q, (N - 1) * H]
            hidden = e.fuse(hidden, rows)
        attn = layer.attn
        q, k, v = attn.project_qkv(layer.attn_input(hidden), positions)
        computed_kv.append((k, v))
        keys, vals, k_pos = k, v, positions
        if attn.sliding_window == 0 and prefix_len > 0:
            cold_k, cold_v = full_prefix_kv[layer.layer_id]
            keys = torch.cat([cold_k[:prefix_len].to(k.dtype), k[prefix_len - start :]])
            vals = torch.cat([cold_v[:prefix_len].to(v.dtype), v[prefix_len - start :]])
            k_pos = torch.arange(seq_len, device=device)
        out = dense_attention(q, keys, vals, positions, k_pos, attn.scale, attn.sliding_window)
        hidden = layer.after_attn(hidden, attn.o_proj(out.reshape(out.shape[0], -1)))
    return model.compute_logits(model.final_norm(hidden)), computed_kv


@torch.no_grad()
def dense_forward(
    model: TinyHybrid | DecoderLM, token_ids: Sequence[int] | torch.Tensor, return_kv: bool = False
) -> torch.Tensor | tuple[torch.Tensor, list[LayerKV]]:
    """A cold causal forward over positions 0..L-1 in one chunk (lookback all -1).

    Returns logits fp32 [L, vocab], and with `return_kv` also every layer's (k, v) [L, H_kv, head_dim]:
    what a cold run would have cached, for `replay_reference`.
    """
    logits, kv = _truncated_forward(model, _as_ids(model, token_ids), 0, None, 0)
    return (logits, kv) if return_kv else logits


@torch.no_grad()
def replay_reference(
    model: TinyHybrid | DecoderLM,
    token_ids: Sequence[int] | torch.Tensor,
    hit_tokens: int,
    replay_start: int,
    cold_kv: list[LayerKV] | None,
) -> torch.Tensor:  # fp32 [L - replay_start, vocab]
    """DESIGN section 4: the output of a request that hit `hit_tokens` cached tokens and replays from
    `replay_start`.

    Only positions [replay_start, L) are computed. Sliding-window layers see keys from replay_start on
    only; full-attention layers read `cold_kv` (from `dense_forward(..., return_kv=True)` over a sequence
    sharing the first `hit_tokens` ids) for positions < hit_tokens, and this pass's K/V from there on. The
    engram still sees the true ids before replay_start, as the worker's token history supplies them.
    """
    ids = _as_ids(model, token_ids)
    seq_len = ids.shape[0]
    if not (0 <= replay_start <= hit_tokens <= seq_len and replay_start < seq_len):
        raise ValueError(
            "replay_reference: need 0 <= replay_start <= hit_tokens <= L and replay_start < L, got "
            f"replay_start={replay_start}, hit_tokens={hit_tokens}, L={seq_len}"
        )
    if hit_tokens > 0 and (cold_kv is None or any(k.shape[0] < hit_tokens for k, _ in cold_kv)):
        raise ValueError(f"cold_kv: every layer's K/V must cover the {hit_tokens} hit tokens")
    logits, _ = _truncated_forward(model, ids, replay_start, cold_kv, hit_tokens)
    return logits
