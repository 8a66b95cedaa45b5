"""Token sampling from logits: greedy, or temperature with top-k and top-p.

A request with a seed draws from a generator seeded by (seed, output position), so its tokens do not
depend on which other requests share the batch, on preemption, or on the shard that runs it.
"""

from __future__ import annotations

import torch

from raystate.messages import SamplingParams

_SEED_STRIDE = 1_000_003


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits fp32 [V] -> logits with the excluded tokens at -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        cut = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,  # fp32 [B, V]
        params: list[SamplingParams],
        output_positions: list[int],  # per row: how many tokens the request had generated before this one
    ) -> torch.Tensor:  # int64 [B]
        sampled = torch.argmax(logits, dim=-1)
        for i, p in enumerate(params):
            if p.temperature == 0.0:
                continue
            row = _filter_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
            probs = torch.softmax(row, dim=-1)
            if p.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed((p.seed * _SEED_STRIDE + output_positions[i]) & 0x7FFF_FFFF_FFFF_FFFF)
            else:
                gen = self.generator
            sampled[i] = torch.multinomial(probs, 1, generator=gen)[0]
        return sampled
