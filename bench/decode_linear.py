"""A decode-sized linear kernel for bench_gemm.py: x [M <= 64, K] @ W[N, K]^T with the ops around it fused.

Measured against cuBLAS on the H200 (BENCHMARKS.md, "Decode GEMMs") and slower there, so the model keeps
cuBLAS and this lives with the benchmark as the measured alternative, not in raystate.kernels.

What it tries, because at decode batch sizes a projection should take its weight bytes over the HBM
bandwidth and cuBLAS reaches 0.31-0.69 of that on the bench model's projections:

- `norm_weight`: x is RMS-normalised on the fly: each program accumulates sum(x^2) over the K it reads
  and multiplies x by the norm weight; the row's 1 / rms scales the fp32 accumulator at the end (one
  number per row, so it commutes with the sum over K). Replaces the separate RMSNorm launch.
- `silu_mul`: W holds gate rows [0, N) then up rows [N, 2N); a program accumulates both for the same
  columns and writes silu(gate) * up. Replaces the SwiGLU-gate launch and the [M, 2N] intermediate.
- `residual`: the output is projection + residual (the residual stream update).
- Split K: a program owns BLOCK_N columns and 1 / SPLIT_K of K. Each writes fp32 partials to a
  workspace; the last program of a column tile to arrive (an atomic counter) adds them in split order
  (deterministic), applies the epilogue and re-arms the counter. One launch, no separate reduce.
- Programmatic dependent launch (PDL, Hopper): the kernel may start while the previous one runs; before
  `griddepcontrol.wait` a program asks L2 to prefetch its share of the weights (no kernel writes them),
  then lets the next kernel start. `set_launch` turns either off, for side-by-side timing.

Rows are one 64-row tile whatever M is (padding rows masked), so a row's result does not depend on M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from raystate.kernels._common import cdiv, interpreting, use_triton

_launch = {"pdl": True, "prefetch": True}


def set_launch(pdl: bool = True, prefetch: bool = True) -> None:
    """Launch later calls with programmatic dependent launch (where supported) or without it, and with
    or without the weight prefetch before the wait (which needs PDL)."""
    _launch["pdl"], _launch["prefetch"] = pdl, prefetch


def pdl_options(tensor: torch.Tensor) -> dict:
    """`launch_pdl` and the kernel's USE_PDL constexpr, always together (a kernel launched early must wait):
    on for CUDA devices of compute capability 9.0+ whose Triton has the gdc intrinsics."""
    cuda = getattr(tl.extra, "cuda", None)
    on = (
        _launch["pdl"]
        and tensor.is_cuda
        and hasattr(cuda, "gdc_wait")
        and torch.cuda.get_device_capability(tensor.device)[0] >= 9
    )
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


MAX_ROWS = 64  # the row tile: decode batches up to this size take this kernel
_BLOCK_M = MAX_ROWS


def decode_linear_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K], or [2N, K] (gate rows then up rows) with silu_mul
    *,
    norm_weight: torch.Tensor | None = None,  # [K]: RMS-normalise x first
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,  # [M, N]: added to the projection
) -> torch.Tensor:  # [M, N]
    """The unfused torch ops this kernel replaces, each rounded to x's dtype as the model rounds them."""
    if norm_weight is not None:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
        x = (x32 * norm_weight.float()).to(x.dtype)
    y = torch.nn.functional.linear(x, weight)
    if silu_mul:
        gate, up = y.float().chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up).to(x.dtype)
    if residual is not None:
        y = y + residual
    return y


@triton.jit
def _prefetch_rows_l2(row_ptrs, num_bytes, valid):
    """Asks L2 for `num_bytes` starting at each of `row_ptrs` (16-byte aligned, a multiple of 16), one
    bulk prefetch per row; rows where `valid` is false issue nothing."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r",
        [row_ptrs, num_bytes, valid.to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _finish(
    acc,  # fp32 [BLOCK_M, BLOCK_N]
    acc_up,  # fp32 [BLOCK_M, BLOCK_N] (SILU_MUL only)
    sumsq,  # fp32 [BLOCK_M] (HAS_NORM only)
    out_ptr,
    residual_ptr,
    offs_m,
    offs_n,
    out_mask,
    stride_out,
    stride_res,
    eps,
    K: tl.constexpr,
    HAS_NORM: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    out_ty = out_ptr.dtype.element_ty
    if HAS_NORM:
        inv_rms = 1.0 / tl.sqrt(sumsq / K + eps)
        acc = acc * inv_rms[:, None]
        if SILU_MUL:
            acc_up = acc_up * inv_rms[:, None]
    y = acc.to(out_ty).to(tl.float32)  # rounded like the projection's output
    if SILU_MUL:
        up = acc_up.to(out_ty).to(tl.float32)
        y = (y / (1.0 + tl.exp(-y)) * up).to(out_ty).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + offs_m[:, None] * stride_res + offs_n[None, :], mask=out_mask, other=0.0)
        y = y + r.to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_out + offs_n[None, :], y.to(out_ty), mask=out_mask)


# Strides stay specialized: Triton then knows they are multiples of 16 and vectorizes the loads (without
# that the kernel ran at a fifth of the bandwidth). The row count is not, so M = 1..64 share one compile.
@triton.jit(do_not_specialize=["num_rows"])
def _decode_linear_kernel(
    x_ptr,  # [M, K], unit column stride
    w_ptr,  # [N, K] ([2N, K] with SILU_MUL), unit column stride
    out_ptr,  # [M, N]
    residual_ptr,  # [M, N] (HAS_RESIDUAL; may be out_ptr)
    norm_ptr,  # [K] (HAS_NORM)
    partial_ptr,  # fp32 [SPLIT_K, BLOCK_M, ACC_COLS] workspace (SPLIT_K > 1)
    sumsq_ptr,  # fp32 [SPLIT_K, BLOCK_M] workspace (SPLIT_K > 1 and HAS_NORM)
    count_ptr,  # int32 [>= column tiles], zero between launches (SPLIT_K > 1)
    num_rows,  # M
    stride_x,
    stride_w,
    stride_out,
    stride_res,
    eps,
    N: tl.constexpr,  # output columns
    K: tl.constexpr,
    ACC_COLS: tl.constexpr,  # N, or 2N with SILU_MUL: the workspace's row length
    HAS_NORM: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # every split covers whole BLOCK_K blocks inside K: no K mask
    PREFETCH: tl.constexpr,  # with USE_PDL: L2-prefetch this program's weights before the wait
    ELEM_BYTES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 operands (as cuBLAS computes them), else "tf32" (unused)
    DOT_IN_FP32: tl.constexpr,  # Triton's CPU interpreter gets bf16 tl.dot wrong: upcast there
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    K_BLOCKS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    SPLIT_BLOCKS: tl.constexpr = (K_BLOCKS + SPLIT_K - 1) // SPLIT_K
    k_lo = pid_k * (SPLIT_BLOCKS * BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_valid = offs_m < num_rows
    n_valid = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64) * stride_w  # [BLOCK_N] row starts (gate rows with SILU_MUL)
    if USE_PDL:
        if PREFETCH:
            share = (tl.minimum(k_lo + SPLIT_BLOCKS * BLOCK_K, K) - k_lo) * ELEM_BYTES
            share_valid = n_valid & (share > 0)
            share_bytes = tl.maximum(share, 0) + offs_n * 0  # [BLOCK_N]
            _prefetch_rows_l2(w_rows + k_lo, share_bytes, share_valid)
            if SILU_MUL:
                _prefetch_rows_l2(w_rows + N * stride_w + k_lo, share_bytes, share_valid)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_x  # [BLOCK_M]
    for kb in range(SPLIT_BLOCKS):
        k = k_lo + kb * BLOCK_K + offs_k
        if EVEN_K:
            x = tl.load(x_rows[:, None] + k[None, :], mask=m_valid[:, None], other=0.0)
            w = tl.load(w_rows[:, None] + k[None, :], mask=n_valid[:, None], other=0.0)
        else:
            k_valid = k < K
            x = tl.load(x_rows[:, None] + k[None, :], mask=m_valid[:, None] & k_valid[None, :], other=0.0)
            w = tl.load(w_rows[:, None] + k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        if HAS_NORM:
            x32 = x.to(tl.float32)
            sumsq += tl.sum(x32 * x32, axis=1)
            g = tl.load(norm_ptr + k, mask=k < K, other=0.0)
            x = (x32 * g.to(tl.float32)[None, :]).to(x_ptr.dtype.element_ty)
        if DOT_IN_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if SILU_MUL:
            up_ptrs = w_rows[:, None] + N * stride_w + k[None, :]
            if EVEN_K:
                w_up = tl.load(up_ptrs, mask=n_valid[:, None], other=0.0)
            else:
                w_up = tl.load(up_ptrs, mask=n_valid[:, None] & (k < K)[None, :], other=0.0)
            if DOT_IN_FP32:
                w_up = w_up.to(tl.float32)
            acc_up = tl.dot(x, tl.trans(w_up), acc_up, input_precision=DOT_PRECISION)

    out_mask = m_valid[:, None] & n_valid[None, :]
    if SPLIT_K == 1:
        _finish(
            acc, acc_up, sumsq, out_ptr, residual_ptr, offs_m, offs_n, out_mask,
            stride_out, stride_res, eps, K, HAS_NORM, SILU_MUL, HAS_RESIDUAL,
        )  # fmt: skip
    else:
        # This split's partial sums (all BLOCK_M rows: the workspace has them), then the arrival count.
        part = partial_ptr + offs_m[:, None] * ACC_COLS + offs_n[None, :]  # split 0's [BLOCK_M, BLOCK_N]
        col_mask = (offs_m >= 0)[:, None] & n_valid[None, :]
        tl.store(part + pid_k * (BLOCK_M * ACC_COLS), acc, mask=col_mask)
        if SILU_MUL:
            tl.store(part + pid_k * (BLOCK_M * ACC_COLS) + N, acc_up, mask=col_mask)
        if HAS_NORM:
            tl.store(sumsq_ptr + pid_k * BLOCK_M + offs_m, sumsq)  # the same in every column tile
        tl.debug_barrier()  # every thread's partials are written before the count says so
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last split of this column tile: reduce in split order
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s in range(SPLIT_K):
                split_part = part + s * (BLOCK_M * ACC_COLS)
                acc += tl.load(split_part, mask=col_mask, other=0.0, cache_modifier=".cg")
                if SILU_MUL:
                    acc_up += tl.load(split_part + N, mask=col_mask, other=0.0, cache_modifier=".cg")
                if HAS_NORM:
                    sumsq += tl.load(sumsq_ptr + s * BLOCK_M + offs_m, cache_modifier=".cg")
            _finish(
                acc, acc_up, sumsq, out_ptr, residual_ptr, offs_m, offs_n, out_mask,
                stride_out, stride_res, eps, K, HAS_NORM, SILU_MUL, HAS_RESIDUAL,
            )  # fmt: skip
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # re-armed for the next launch


@dataclass(frozen=True)
class LinearTile:
    """One launch configuration of the decode linear kernel."""

    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def tag(self) -> str:
        return f"N{self.block_n} K{self.block_k} split{self.split_k} w{self.num_warps} s{self.num_stages}"


_sm_count: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: a small grid, still split, so CPU tests cover the reduction
    index = device.index if device.index is not None else torch.cuda.current_device()
    n = _sm_count.get(index)
    if n is None:
        n = _sm_count[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


def default_tile(n: int, k: int, silu_mul: bool, device: torch.device) -> LinearTile:
    """BLOCK_N 64 (gate and up 64 each with silu_mul) and the largest split K (a power of two, each
    split at least two 128-wide K blocks) that keeps the grid within 1.5 programs per SM: enough
    programs streaming weights to fill HBM without a second wave."""
    block_n, block_k = 64, 128
    tiles = cdiv(n, block_n)
    k_blocks = cdiv(k, block_k)
    budget = _num_sms(device) * 3 // 2
    split = 1
    while split * 2 * 2 <= k_blocks and tiles * split * 2 <= budget:
        split *= 2
    return LinearTile(block_n=block_n, block_k=block_k, split_k=split)


class _Workspace:
    """Per-device fp32 partial sums and arrival counters of the split-K reduction.

    Allocated (zeroed) on first use outside CUDA graph capture and grown only there: a graph keeps the
    addresses it captured, and every launch leaves the counters at zero again. Launches on one stream
    run one after another (a PDL launch waits before it touches the workspace), so one is shared by all.
    """

    def __init__(self) -> None:
        self._by_device: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device, partial_elems: int, sumsq_elems: int, counters: int):
        key = (device.type, device.index)
        have = self._by_device.get(key)
        if (
            have is not None
            and have[0].numel() >= partial_elems
            and have[1].numel() >= sumsq_elems
            and have[2].numel() >= counters
        ):
            return have
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "decode_linear: the split-K workspace must be allocated before CUDA graph capture "
                "(run the step once eagerly first, as the graph runner's warm-up does)"
            )
        if have is not None:
            partial_elems = max(partial_elems, have[0].numel())
            sumsq_elems = max(sumsq_elems, have[1].numel())
            counters = max(counters, have[2].numel())
        have = (
            torch.zeros(max(partial_elems, 1), dtype=torch.float32, device=device),
            torch.zeros(max(sumsq_elems, 1), dtype=torch.float32, device=device),
            torch.zeros(max(counters, 1), dtype=torch.int32, device=device),
        )
        self._by_device[key] = have
        return have


_workspace = _Workspace()


def decode_linear_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `decode_linear` runs the kernel on these operands (else it runs `decode_linear_ref`)."""
    return (
        use_triton(x)
        and x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and weight.shape[1] == x.shape[1]
        and x.dtype == weight.dtype
        and x.shape[1] % 8 == 0
        and weight.stride(0) % 8 == 0
        and weight.data_ptr() % 16 == 0
    )


def decode_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K], or [2N, K] with silu_mul
    *,
    norm_weight: torch.Tensor | None = None,  # [K]
    eps: float = 1e-6,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,  # [M, N]
    out: torch.Tensor | None = None,  # [M, N]; may be `residual` (the stream updated in place)
    tile: LinearTile | None = None,
) -> torch.Tensor:  # [M, N]
    """norm(x) @ W^T (silu(gate) * up with silu_mul) + residual, in one launch and no host sync.

    Takes the kernel for M <= 64 on CUDA (or under the interpreter), else runs the same ops unfused.
    """
    rows, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    if silu_mul and weight.shape[0] % 2:
        raise ValueError(f"weight: silu_mul needs gate and up rows (an even count), got {weight.shape[0]}")
    if residual is not None and tuple(residual.shape) != (rows, n):
        raise ValueError(f"residual: expected shape {(rows, n)}, got {tuple(residual.shape)}")
    if not decode_linear_supported(x, weight):
        y = decode_linear_ref(
            x, weight, norm_weight=norm_weight, eps=eps, silu_mul=silu_mul, residual=residual
        )
        if out is None:
            return y
        out.copy_(y)
        return out
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    tile = tile or default_tile(n, k, silu_mul, x.device)
    acc_cols = 2 * n if silu_mul else n
    tiles = cdiv(n, tile.block_n)
    split = tile.split_k
    partial, sumsq, counts = _workspace.get(
        x.device,
        split * _BLOCK_M * acc_cols if split > 1 else 0,
        split * _BLOCK_M if split > 1 else 0,
        tiles if split > 1 else 0,
    )
    k_blocks = cdiv(k, tile.block_k)
    res = residual if residual is not None else out
    _decode_linear_kernel[(tiles, split)](
        x,
        weight,
        out,
        res,
        norm_weight if norm_weight is not None else x,
        partial,
        sumsq,
        counts,
        rows,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        res.stride(0),
        eps,
        N=n,
        K=k,
        ACC_COLS=acc_cols,
        HAS_NORM=norm_weight is not None,
        SILU_MUL=silu_mul,
        HAS_RESIDUAL=residual is not None,
        BLOCK_M=_BLOCK_M,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        SPLIT_K=split,
        EVEN_K=k % tile.block_k == 0 and k_blocks % split == 0,
        PREFETCH=_launch["prefetch"],
        ELEM_BYTES=x.element_size(),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        DOT_IN_FP32=interpreting() and x.dtype == torch.bfloat16,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        **pdl_options(x),
    )
    return out
