"""A plain beam search over a next-token log-probability function, written apart from
`raystate.beam_search` to check it: vLLM's rules (2 * width candidates per beam, EOS candidates set aside,
score = cumulative logprob / length ** length_penalty with the prompt counted and a final EOS not).
Importable from every test folder: tests/conftest.py puts tests/ on sys.path."""

from __future__ import annotations

from collections.abc import Callable

import torch


def reference_beam_search(
    next_logprobs: Callable[[list[int]], torch.Tensor],  # tokens -> fp32 [V] log-probabilities
    prompt: list[int],
    width: int,
    max_tokens: int,
    eos: set[int],
    ignore_eos: bool = False,
    length_penalty: float = 1.0,
) -> list[tuple[list[int], float, bool]]:
    """The `width` best (tokens, cumulative logprob, ended with EOS), best first."""

    def score(c: tuple[list[int], float, bool]) -> float:
        tokens, cum, ended = c
        return cum / ((len(tokens) - int(ended)) ** length_penalty)

    live: list[tuple[list[int], float, bool]] = [(list(prompt), 0.0, False)]
    finished = []
    for _ in range(max_tokens):
        if not live:
            break
        candidates = []
        for tokens, cum, _ended in live:
            top = torch.topk(next_logprobs(tokens), 2 * width)
            for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                if t in eos and not ignore_eos:
                    finished.append((tokens + [t], cum + v, True))
                else:
                    candidates.append((tokens + [t], cum + v, False))
        live = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(finished + live, key=score, reverse=True)[:width]
