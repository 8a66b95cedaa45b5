"""Decode projections split over K into fp32 partial sums, summed by the kernel that reads them next.

Why: at decode sizes (a few dozen rows) a projection with a narrow output (Gemma-3-4B's o and down
projections: 2560 columns, 40 tiles of 64) gives cuBLAS too few tiles for the GPU's SMs; it either leaves
most SMs idle (o: 0.36 of the copy bandwidth on an H200) or splits K itself and launches a reduce kernel
after the GEMM (down: 2.3 us and a launch gap a layer). Here the projection runs as S GEMMs over K slices
in one strided batched launch (`torch.bmm` on views of x and the weight, no copy, fp32 out), and the
S partials are summed by the consumer, which in every decoder layout is the fused residual-add RMSNorm
(`raystate.kernels.norm.rms_norm` takes a `PartialSums` for x). The sum is rounded to the weights' dtype
before anything else reads it, as the GEMM's own output would be.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from raystate.kernels._common import env_choice
from raystate.kernels.attention_launch import device_limits

# RAYSTATE_SPLIT_K=0 (read at import) keeps every projection a plain GEMM; set_enabled does the same at run
# time (benchmarks compare the two in one process). A CUDA graph keeps the launches it captured.
_enabled = env_choice("RAYSTATE_SPLIT_K", ("0", "1"), "1") == "1"
# torch.bmm takes out_dtype (fp32 out of half-precision inputs) from torch 2.8; an older torch keeps every
# projection a plain GEMM.
_BMM_OUT_DTYPE = torch.__version__ >= "2.8"


def set_enabled(enabled: bool) -> bool:
    """Turns split-K projections on or off for later calls; returns the previous setting."""
    global _enabled
    previous, _enabled = _enabled, enabled
    return previous


class PartialSums(NamedTuple):
    """A projection's output as S fp32 partial sums over slices of K: out = sum(parts).to(dtype)."""

    parts: torch.Tensor  # fp32 [S, T, N]
    dtype: torch.dtype  # the projection's own output dtype (the weights')

    @property
    def shape(self) -> torch.Size:  # [T, N], the projection's
        return self.parts.shape[1:]

    def total(self) -> torch.Tensor:  # [T, N] in dtype: the projection's output
        parts = self.parts
        summed = parts[0]
        for s in range(1, parts.shape[0]):
            summed = summed + parts[s]  # in order, as the consumers' kernels add them
        return summed.to(self.dtype)


def split_k_linear(
    x: torch.Tensor,  # [T, K], rows contiguous
    weight: torch.Tensor,  # [N, K], an nn.Linear's (no bias): row-major, or column-major (weight_layout)
    splits: int,  # S: divides K
) -> PartialSums:  # parts fp32 [S, T, N]
    """x @ weight.T as S partial sums over equal slices of K, one batched GEMM on the GPU."""
    num_tokens, k = x.shape
    n = weight.shape[0]
    if k % splits or x.stride(-1) != 1 or not _dense_2d(weight):
        raise ValueError(
            f"splits: {splits} must divide K = {k}, with x's rows contiguous and the weight row- or "
            "column-major"
        )
    part = k // splits
    n_stride, k_stride = weight.stride()
    # Slice s of x is x[:, s*part:(s+1)*part], of the weight its same columns: strided views, no copy.
    xs = x.as_strided((splits, num_tokens, part), (part, x.stride(0), 1))  # [S, T, K/S]
    ws = weight.as_strided((splits, part, n), (part * k_stride, k_stride, n_stride))  # [S, K/S, N]
    if x.is_cuda and x.dtype != torch.float32:
        parts = torch.bmm(xs, ws, out_dtype=torch.float32)
    else:  # (out_dtype is for half-precision inputs on CUDA) the same sums from fp32 copies
        parts = torch.bmm(xs.float(), ws.float())
    return PartialSums(parts, weight.dtype)


def split_k_count(num_tokens: int, k: int, n: int, num_sms: int) -> int:
    """S for a decode projection: 2 where the output is too narrow to give every SM a tile, else 1.

    At up to 64 rows cuBLAS tiles the output 64 columns wide, so N / 64 tiles; below one per SM it idles
    SMs or adds its own split-K reduce launch. Two slices were the best or within 3% of the best of
    1-8 for every narrow projection timed (Gemma-3-4B's o and down, Qwen3-8B's o and down, at 64 and 8
    rows; H100, `bench/bench_split_gemm.py`; Qwen3-8B's o at 64 rows gains nothing, 15.79 against
    15.68 us), and each more slice is another fp32 partial for the norm to read. Slices shorter than 256
    are not worth a GEMM's pipeline.
    """
    if not 0 < num_tokens <= 64 or -(-n // 64) >= num_sms or k % 2 or k // 2 < 256:
        return 1
    return 2


def _dense_2d(weight: torch.Tensor) -> bool:  # [N, K]
    """Row-major or column-major with no gaps: every K slice is a strided view of it."""
    return weight.is_contiguous() or weight.t().is_contiguous()


def splits_for(x: torch.Tensor, weight: torch.Tensor) -> int:  # x [T, K], weight [N, K]
    """S for the projection of x by weight on x's GPU: 1 off the GPU, when split-K is turned off, when
    x's rows are not contiguous or the weight is neither row- nor column-major (the slices are strided
    views of them)."""
    if not (_enabled and _BMM_OUT_DTYPE and x.is_cuda and x.stride(-1) == 1 and _dense_2d(weight)):
        return 1
    n, k = weight.shape
    return split_k_count(x.shape[0], k, n, device_limits(x.device.index or 0)[1])
