"""Projection weights stored column-major ([K, N] in memory) on the GPU: the layout cuBLAS streams fastest.

Why: an `nn.Linear` keeps its weight [N, K] row-major, so `x @ W.T` is a "TN" GEMM. Stored the other way
round (the same [N, K] tensor with strides (1, N): its transpose is a contiguous [K, N]) the product is an
"NN" GEMM, for which cuBLAS's heuristic picks other kernels. At decode sizes those stream the weights
faster: on an H100 at 64 rows, Gemma-3-4B's 1.34 GB tied head went from 0.89 to 0.98 of the copy
bandwidth (500 -> 454 us) and Qwen3-8B's qkv from 0.69 to 0.75 (`bench/bench_blas.py --layouts --rows 1 8
64 2048`, bench/results/blas_layouts_h100.log; BENCHMARKS.md "Weight layout"). Prefill-sized products of
some shapes are slower (Qwen3-8B's at 2048 rows, 1.08x): RAYSTATE_WEIGHT_LAYOUT below.

Nothing that reads a weight changes: every reader goes through torch with the tensor's strides
(`F.linear`, `torch.mm(x, w.t())`, the embedding's row gather of a tied head, the split-K views of
`raystate.kernels.split_k`), and the values are the same. Only bf16 / fp16 weights on a GPU are re-stored:
an fp32 model is what checks exactness against `transformers`, whose GEMMs read the weights as stored, and
on the CPU the layout buys nothing.

`RAYSTATE_WEIGHT_LAYOUT=as_stored` (read at import) or `set_enabled(False)` keeps every weight as loaded
(benchmarks compare the two in one process).
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import nn

from raystate.kernels._common import env_choice

M = TypeVar("M", bound=nn.Module)

_HALF_DTYPES = (torch.bfloat16, torch.float16)
_enabled = (
    env_choice("RAYSTATE_WEIGHT_LAYOUT", ("column_major", "as_stored"), "column_major") == "column_major"
)


def set_enabled(enabled: bool) -> bool:
    """Turns the column-major storage on or off for models loaded later; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, enabled
    return previous


def is_column_major(weight: torch.Tensor) -> bool:  # [N, K]
    """The weight's transpose is a contiguous [K, N] (and it is not also row-major: N > 1, K > 1)."""
    return weight.dim() == 2 and weight.t().is_contiguous() and not weight.is_contiguous()


def wants_column_major(weight: torch.Tensor) -> bool:  # [N, K]
    """Whether loading re-stores this weight: bf16 / fp16 on a GPU, row-major, at least 2 x 2."""
    half_on_gpu = weight.is_cuda and weight.dtype in _HALF_DTYPES
    return half_on_gpu and weight.is_contiguous() and min(weight.shape) > 1


@torch.no_grad()
def store_projections_column_major(model: M) -> M:
    """Re-stores every `nn.Linear` weight of `model` that `wants_column_major` column-major, in place (the
    Parameter objects stay, so a tied embedding and head stay one tensor); returns the model. Does nothing
    when turned off (`set_enabled`, RAYSTATE_WEIGHT_LAYOUT)."""
    if not _enabled:
        return model
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, nn.Linear):
            continue
        weight = module.weight
        if id(weight) in seen or not wants_column_major(weight):
            continue
        seen.add(id(weight))
        # [N, K] row-major -> a contiguous [K, N] copy, seen through its transpose: the same [N, K] values.
        # One tensor at a time, so loading needs at most one weight's bytes more than the model.
        weight.data = weight.data.t().contiguous().t()
    return model
