"""Helpers for the in-process engine tests: prompts sharing prefixes, the dense greedy oracle and a
logit recorder hooked into the worker."""

from __future__ import annotations

import numpy as np
import torch

from raystate.model.reference import dense_forward


def shared_prefix_prompts(seed: int, num: int, prefix_len: int, vocab: int = 256) -> list[list[int]]:
    """`num` prompts: two families, each sharing a prefix of about `prefix_len` ids, plus random tails."""
    rng = np.random.default_rng(seed)
    bases = [rng.integers(0, vocab, prefix_len).tolist() for _ in range(2)]
    prompts = []
    for i in range(num):
        base = bases[i % 2][: prefix_len - int(rng.integers(0, 8))]
        prompts.append(base + rng.integers(0, vocab, int(rng.integers(3, 20))).tolist())
    return prompts


def greedy_oracle(model, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """A cold one-shot run: the greedy continuation by dense forwards, and the logits at every position."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(dense_forward(model, ids)[-1].argmax()))
    return ids[len(prompt) :], dense_forward(model, ids[:-1])


class LogitLog:
    """Keeps, per request and position, the latest logits row the worker computed."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[int, torch.Tensor]] = {}

    def __call__(self, req_id: str, start: int, logits: torch.Tensor) -> None:
        d = self.rows.setdefault(req_id, {})
        for i in range(logits.shape[0]):
            d[start + i] = logits[i]

    def stacked(self, req_id: str, first: int, last: int) -> torch.Tensor:
        return torch.stack([self.rows[req_id][p] for p in range(first, last)])
