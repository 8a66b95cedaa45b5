"""Token sampling from logits: greedy, or temperature with top-k, top-p and min_p, guarded row by row.

The logits it gets already carry the requests' penalties, logit_bias and min_tokens mask
(`raystate.worker.penalties`, applied to the raw logits before temperature).

A request with a seed draws from a generator seeded by (seed, output position), so its tokens do not
depend on which other requests share the batch, on preemption, or on the shard that runs it.

Nothing one request sends can break another's row, or the shard:
- Temperatures below `MIN_TEMPERATURE` are greedy (the limit of softmax(l / t) as t -> 0 is the argmax;
  in fp32, l / 5e-324 is inf and the softmax NaN). Every other temperature is applied exactly, after
  subtracting the row's largest logit, so l / t never overflows to +inf for any finite t > 0.
- A row whose logits are not finite where it matters (a NaN, a +inf, or every entry -inf) samples
  nothing: its id is `FAILED_ROW` and it never reaches `torch.multinomial`. The check is one reduction
  (`max` propagates NaN) that also yields the greedy id, so the CUDA graph's decode step runs it too.
- A row whose sampling raises (a bad value that got past validation) fails alone, with the error's text.
A failed row's request ends with finish_reason "error"; the other rows of the step are untouched.
"""

from __future__ import annotations

import logging
import math

import torch

from raystate.kernels import greedy
from raystate.messages import FAILED_ROW, SamplingParams

logger = logging.getLogger(__name__)

_SEED_STRIDE = 1_000_003
MIN_TEMPERATURE = 1e-5  # below: greedy
NONFINITE_LOGITS = "the model produced non-finite logits (NaN or inf) for this request"


def greedy_checked(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:  # int64 [B]
    """The argmax of every row of logits [B, V] (any float dtype; ties to the lowest id), or FAILED_ROW
    where the row's maximum is not finite (a NaN anywhere, a +inf, or an all -inf row), into `out` when
    given. No host sync (CUDA-graph safe): `raystate.kernels.greedy` on the GPU, one torch reduction
    elsewhere."""
    return greedy.greedy_checked(logits, FAILED_ROW, out)


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
        cut[0] = False  # also when top_p underflows to 0 in fp32 (5e-324 is a valid top_p)
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, order, sorted_logits)
    return logits


def is_greedy(p: SamplingParams) -> bool:
    return p.temperature < MIN_TEMPERATURE


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
        greedy: torch.Tensor | None = None,  # int64 [B]: `greedy_checked(logits)` if already computed
    ) -> tuple[torch.Tensor, dict[int, str]]:
        """(ids int64 [B] on the device, {row: why} for the rows that failed: their id is FAILED_ROW)."""
        sampled = greedy_checked(logits) if greedy is None else greedy.clone()
        failures: dict[int, str] = {}
        random_rows = [i for i, p in enumerate(params) if not is_greedy(p)]
        if not random_rows:
            return sampled, failures
        finite = (sampled != FAILED_ROW).tolist()  # one sync; multinomial below syncs anyway
        for i in random_rows:
            if not finite[i]:
                continue  # FAILED_ROW already; the scheduler reports NONFINITE_LOGITS
            p = params[i]
            try:
                row = logits[i]
                row = (row - row.max()) / p.temperature  # <= 0 everywhere, the max exactly 0
                row = _filter_top_k_top_p(row, p.top_k, p.top_p)
                if p.min_p > 0.0:  # p_i >= min_p * p_max <=> l_i - l_max >= log(min_p), and l_max is 0
                    row = row.masked_fill(row < math.log(p.min_p), float("-inf"))
                probs = torch.softmax(row, dim=-1)
                if p.seed is not None:
                    gen = torch.Generator(device=self.device)
                    gen.manual_seed((p.seed * _SEED_STRIDE + output_positions[i]) & 0x7FFF_FFFF_FFFF_FFFF)
                else:
                    gen = self.generator
                sampled[i] = torch.multinomial(probs, 1, generator=gen)[0]
            except (RuntimeError, ValueError, TypeError, OverflowError, IndexError) as e:
                # The client gets the exception's type only (torch messages can hold source paths).
                logger.warning("row %d: sampling with %r failed", i, p, exc_info=True)
                sampled[i] = FAILED_ROW
                failures[i] = f"sampling failed ({type(e).__name__})"
        return sampled, failures
