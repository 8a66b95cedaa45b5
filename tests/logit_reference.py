"""The plain per-token reference of the logit controls (allowed_token_ids, bad_words_token_ids,
logit_bias, min_tokens, penalties), shared by the worker's and the engine's tests. Importable from every
test folder: tests/conftest.py puts tests/ on sys.path."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from raystate import SamplingParams


def reference_row(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int], eos: Sequence[int]
) -> torch.Tensor:
    """One row's controlled logits, token by token, in fp32 as the device computes them (`eos`: the
    model's EOS ids, held back by min_tokens unless ignore_eos)."""
    x = logits.clone()
    if not p.has_logit_controls:
        return x
    if p.allowed_token_ids is not None:
        keep = set(p.allowed_token_ids)
        for t in range(x.shape[0]):
            if t not in keep:
                x[t] = float("-inf")
    for seq in p.bad_words_token_ids or ():
        *prefix, last = seq
        if len(output) >= len(prefix) and output[len(output) - len(prefix) :] == prefix:
            x[last] = float("-inf")
    for t, b in (p.logit_bias or {}).items():
        x[t] = x[t] + torch.tensor(b, dtype=torch.float32)
    if len(output) < p.min_tokens:
        for t in [*p.stop_token_ids, *(() if p.ignore_eos else eos)]:
            x[t] = float("-inf")
    rep = torch.tensor(p.repetition_penalty, dtype=torch.float32)
    for t in set(prompt) | set(output):
        x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
    freq = torch.tensor(p.frequency_penalty, dtype=torch.float32)
    pres = torch.tensor(p.presence_penalty, dtype=torch.float32)
    for t in set(output):
        x[t] = x[t] - freq * output.count(t)
        x[t] = x[t] - pres
    return x
