"""The decoder layer's fused kernels (RMSNorm with residual add, SwiGLU gate, rotary + KV store) against
their PyTorch references; the references themselves against the model's unfused torch formulas."""

import pytest
import torch
import torch.nn.functional as F

from raystate.kernels import PAD_SLOT_ID
from raystate.kernels.activation import act_and_mul, act_and_mul_ref, silu_and_mul, silu_and_mul_ref
from raystate.kernels.engram_gate import engram_gate, engram_gate_ref
from raystate.kernels.norm import rms_norm, rms_norm_ref
from raystate.kernels.rotary import rope_write_kv, rope_write_kv_ref
from raystate.kernels.split_k import PartialSums, split_k_linear
from raystate.model.layers import apply_rotary, rotary_table


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(a.float().cpu(), b.float().cpu(), atol=tol, rtol=tol)


def _rope_on_device(on_device, qkv, positions, table, heads, kv_heads, k_cache, v_cache, slots, qk_norm=None):
    """rope_write_kv on the device: qkv and the caches already there, the CPU index tensors copied."""
    return rope_write_kv(
        qkv,
        on_device(positions),
        on_device(table),
        heads,
        kv_heads,
        k_cache,
        v_cache,
        on_device(slots),
        qk_norm,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (5, 130), (17, 2048)])
def test_rms_norm_with_and_without_residual(on_device, dtype, shape):
    gen = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=gen).to(dtype)
    res = torch.randn(shape, generator=gen).to(dtype)
    w = torch.randn(shape[1], generator=gen).to(dtype)
    out, summed = rms_norm(on_device(x), on_device(w), 1e-6)
    ref, none = rms_norm_ref(x, w, 1e-6)
    assert summed is None and none is None
    _close(out, ref, dtype)
    out, summed = rms_norm(on_device(x), on_device(w), 1e-6, residual=on_device(res))
    ref, ref_summed = rms_norm_ref(x, w, 1e-6, residual=res)
    _close(out, ref, dtype)
    _close(summed, ref_summed, dtype)
    # The reference is the model's unfused formula: add, then RMSNorm in fp32.
    s32 = (x + res).float()
    plain = (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(dtype)
    assert torch.equal(ref, plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 130), (9, 2048)])
def test_rms_norm_weight_offset_is_gemmas_one_plus_w(on_device, dtype, shape):
    """Gemma's gain 1 + w, added in fp32 (never folded into a bf16 weight), with and without a residual."""
    gen = torch.Generator().manual_seed(shape[1] + 1)
    x = torch.randn(shape, generator=gen).to(dtype)
    res = torch.randn(shape, generator=gen).to(dtype)
    w = (torch.randn(shape[1], generator=gen) * 0.1).to(dtype)
    for residual in (None, res):
        out, _ = rms_norm(
            on_device(x), on_device(w), 1e-6, on_device(residual) if residual is not None else None, 1.0
        )
        ref, _ = rms_norm_ref(x, w, 1e-6, residual, 1.0)
        _close(out, ref, dtype)
    s32 = x.float()
    gemma = (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).to(dtype)
    assert torch.equal(rms_norm_ref(x, w, 1e-6, None, 1.0)[0], gemma)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (4, 130), (9, 2560)])
def test_rms_norm_pre_weight_is_the_sandwich_norm_add_norm(on_device, dtype, shape):
    """Gemma's post-sublayer norm, residual add and next norm in one launch equal the three steps."""
    gen = torch.Generator().manual_seed(shape[1] + 2)
    x = (torch.randn(shape, generator=gen) * 40).to(dtype)  # a sublayer output far from unit scale
    res = torch.randn(shape, generator=gen).to(dtype)
    w_pre, w = ((torch.randn(shape[1], generator=gen) * 0.3).to(dtype) for _ in range(2))
    out, summed = rms_norm(on_device(x), on_device(w), 1e-6, on_device(res), 1.0, on_device(w_pre))
    ref, ref_summed = rms_norm_ref(x, w, 1e-6, res, 1.0, w_pre)
    _close(summed, ref_summed, dtype)
    _close(out, ref, dtype)
    # The reference is the unfused chain, bit for bit: norm the output, add (rounded), norm the sum.
    normed_x = rms_norm_ref(x, w_pre, 1e-6, None, 1.0)[0]
    chain, chain_summed = rms_norm_ref(normed_x, w, 1e-6, res, 1.0)
    assert torch.equal(ref, chain) and torch.equal(ref_summed, chain_summed)
    assert torch.equal(chain_summed, normed_x + res)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("shape", [(1, 8), (5, 130), (4, 2560)])
def test_rms_norm_sums_split_k_partials_first(on_device, dtype, splits, shape):
    """A split-K projection's fp32 partials into the norm: as if the norm had read their sum, rounded to
    the projection's dtype (what the plain GEMM would have written), in all three of the norm's forms."""
    gen = torch.Generator().manual_seed(shape[1] + splits)
    parts = torch.randn((splits, *shape), generator=gen) * 8
    # (a small stream: where x + residual cancels, one rounding of x apart is many of the sum's ulps, and
    # Triton's interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest even)
    res = (torch.randn(shape, generator=gen) * 0.1).to(dtype)
    w_pre, w = ((torch.randn(shape[1], generator=gen) * 0.3).to(dtype) for _ in range(2))
    partial = PartialSums(on_device(parts), dtype)
    total = PartialSums(parts, dtype).total()
    assert total.dtype == dtype and total.shape == shape
    torch.testing.assert_close(total.float(), parts.sum(0).to(dtype).float(), atol=0, rtol=0)
    for kw in ({}, {"residual": res}, {"residual": res, "pre_weight": w_pre}):
        got = rms_norm(
            partial, on_device(w), 1e-6, weight_offset=1.0, **{k: on_device(v) for k, v in kw.items()}
        )
        want = rms_norm_ref(total, w, 1e-6, weight_offset=1.0, **kw)
        assert got[0].dtype == dtype and got[0].shape == shape
        _close(got[0], want[0], dtype)
        if "residual" in kw:
            _close(got[1], want[1], dtype)
        else:
            assert got[1] is None and want[1] is None


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_split_k_linear_partials_sum_to_the_projection(splits):
    gen = torch.Generator().manual_seed(splits)
    x = torch.randn(6, 64, generator=gen)
    w = torch.randn(24, 64, generator=gen)
    parts = split_k_linear(x, w, splits)
    assert parts.parts.shape == (splits, 6, 24) and parts.dtype == torch.float32
    torch.testing.assert_close(parts.total(), x @ w.T, rtol=1e-5, atol=1e-5)
    # each partial is its own slice of K
    part = 64 // splits
    torch.testing.assert_close(parts.parts[-1], x[:, -part:] @ w[:, -part:].T, rtol=1e-5, atol=1e-5)
    # a view of a wider buffer (the attention output reshaped, a row stride > K) is sliced the same way
    wide = torch.randn(6, 80, generator=gen)
    wide[:, :64] = x
    torch.testing.assert_close(split_k_linear(wide[:, :64], w, splits).total(), x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_split_k_linear_takes_a_column_major_weight(splits):
    """A weight stored column-major (raystate.model.weight_layout: its transpose contiguous) is sliced
    over K by its own strides: each partial is the same slice's product as for the row-major copy."""
    gen = torch.Generator().manual_seed(10 + splits)
    x = torch.randn(6, 64, generator=gen)
    w = torch.randn(24, 64, generator=gen)
    w_cols = w.t().contiguous().t()  # [24, 64], strides (1, 24)
    assert w_cols.stride() == (1, 24)
    parts = split_k_linear(x, w_cols, splits)
    part = 64 // splits
    for s in range(splits):
        want = x[:, s * part : (s + 1) * part] @ w[:, s * part : (s + 1) * part].T
        torch.testing.assert_close(parts.parts[s], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts.total(), split_k_linear(x, w, splits).total(), rtol=1e-6, atol=1e-6)


def test_split_k_refuses_a_weight_neither_row_nor_column_major():
    every_other_column = torch.zeros(8, 128)[:, ::2]  # [8, 64], strides (128, 2)
    with pytest.raises(ValueError, match="row- or column-major"):
        split_k_linear(torch.zeros(2, 64), every_other_column, 2)


def test_split_k_refuses_a_split_that_does_not_divide_k():
    with pytest.raises(ValueError, match="splits: 3 must divide K = 64"):
        split_k_linear(torch.zeros(2, 64), torch.zeros(8, 64), 3)


def test_split_k_count_splits_only_narrow_decode_projections():
    from raystate.kernels.split_k import split_k_count, splits_for

    # Gemma-3-4B on 132 SMs: o (2048 -> 2560) and down (10240 -> 2560) are 40 tiles of 64 columns
    assert split_k_count(64, 2048, 2560, 132) == 2
    assert split_k_count(64, 10240, 2560, 132) == 2
    assert split_k_count(8, 12288, 4096, 132) == 2  # Qwen3-8B's down: 64 tiles
    assert split_k_count(64, 2560, 20480, 132) == 1  # gate_up: 320 tiles already
    assert split_k_count(64, 4096, 8448, 132) == 1  # 132 tiles: one per SM
    assert split_k_count(65, 2048, 2560, 132) == 1  # more rows than a decode tile: cuBLAS as is
    assert split_k_count(0, 2048, 2560, 132) == 1
    assert split_k_count(8, 384, 2560, 132) == 1  # slices of 192
    assert split_k_count(8, 2051, 2560, 132) == 1  # K odd
    assert splits_for(torch.zeros(8, 2048), torch.zeros(2560, 2048)) == 1  # off the GPU: never


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (3, 1, 8), (8, 4, 256)])
def test_rope_write_kv_with_qk_norm_equals_norm_then_rotate(on_device, dtype, heads, kv_heads, head_dim):
    """Qwen3 / Gemma 3's per-head q and k norms fused into the rotation equal the separate norm first."""
    from raystate.kernels.norm import rms_norm_heads_ref

    gen = torch.Generator().manual_seed(heads * head_dim + 1)
    num_tokens, num_blocks, block_size, max_pos = 7, 4, 4, 32
    qkv = (torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 5).to(dtype)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[0] = PAD_SLOT_ID
    table = rotary_table(head_dim, 10000.0, max_pos, torch.device("cpu"))
    q_w, k_w = ((torch.randn(head_dim, generator=gen) * 0.3).to(dtype) for _ in range(2))
    kc = torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    vc = torch.zeros_like(kc)
    kc_dev, vc_dev = on_device(kc), on_device(vc)
    qkv_dev = on_device(qkv)
    norm = (on_device(q_w), on_device(k_w), 1e-6, 1.0)
    q = _rope_on_device(on_device, qkv_dev, positions, table, heads, kv_heads, kc_dev, vc_dev, slots, norm)
    assert torch.equal(qkv_dev.cpu(), qkv)  # the projection is read, not normalised in place
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = rope_write_kv_ref(
        qkv, positions, table, heads, kv_heads, kc_ref, vc_ref, slots, (q_w, k_w, 1e-6, 1.0)
    )
    _close(q, q_ref, dtype)
    _close(kc_dev, kc_ref, dtype)
    assert torch.equal(vc_dev.cpu(), vc_ref)
    # The reference is the unfused pair: the in-place head norms, then the plain rotation.
    normed = rms_norm_heads_ref(qkv.clone(), q_w, 1e-6, 1.0, 0, head_dim, heads)
    normed = rms_norm_heads_ref(normed, k_w, 1e-6, 1.0, heads * head_dim, head_dim, kv_heads)
    kc2, vc2 = kc.clone(), vc.clone()
    assert torch.equal(q_ref, rope_write_kv_ref(normed, positions, table, heads, kv_heads, kc2, vc2, slots))
    assert torch.equal(kc_ref, kc2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 4), (3, 1500), (9, 256)])
def test_gelu_tanh_and_mul(on_device, dtype, rows, width):
    gen = torch.Generator().manual_seed(width + 7)
    gate_up = torch.randn(rows, 2 * width, generator=gen).to(dtype) * 3
    got = act_and_mul(on_device(gate_up), "gelu_tanh")
    ref = act_and_mul_ref(gate_up, "gelu_tanh")
    _close(got, ref, dtype)
    g, u = gate_up.float().chunk(2, dim=-1)
    _close(ref, F.gelu(g, approximate="tanh") * u, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 4), (3, 1500), (9, 256)])
def test_silu_and_mul(on_device, dtype, rows, width):
    gen = torch.Generator().manual_seed(width)
    gate_up = torch.randn(rows, 2 * width, generator=gen).to(dtype) * 3
    got = silu_and_mul(on_device(gate_up))
    ref = silu_and_mul_ref(gate_up)
    assert got.shape == (rows, width)
    _close(got, ref, dtype)
    g, u = gate_up.float().chunk(2, dim=-1)
    _close(ref, F.silu(g) * u, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (3, 1, 8), (16, 4, 128)])
def test_rope_write_kv_matches_reference_and_skips_pad_slots(on_device, dtype, heads, kv_heads, head_dim):
    gen = torch.Generator().manual_seed(heads * head_dim)
    num_tokens, num_blocks, block_size, max_pos = 11, 6, 4, 64
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.3] = PAD_SLOT_ID
    table = rotary_table(head_dim, 10000.0, max_pos, torch.device("cpu"))
    kc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    vc = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    kc_dev, vc_dev = on_device(kc), on_device(vc)
    q = _rope_on_device(on_device, on_device(qkv), positions, table, heads, kv_heads, kc_dev, vc_dev, slots)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref = rope_write_kv_ref(qkv, positions, table, heads, kv_heads, kc_ref, vc_ref, slots)
    _close(q, q_ref, dtype)
    _close(kc_dev, kc_ref, dtype)
    assert torch.equal(vc_dev.cpu(), vc_ref)  # values are copied, not computed
    # Untouched slots keep their bits.
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(
        kc_dev.cpu().view(-1, kv_heads, head_dim)[untouched], kc.view(-1, kv_heads, head_dim)[untouched]
    )
    # The reference rotates exactly as the model's apply_rotary does.
    q_plain = apply_rotary(qkv.view(num_tokens, -1, head_dim)[:, :heads], positions, 10000.0)
    assert torch.equal(q_ref, q_plain)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 16), (7, 128), (5, 2048)])
def test_engram_gate(on_device, dtype, rows, width):
    gen = torch.Generator().manual_seed(rows * width)
    hidden, key, value = (torch.randn(rows, width, generator=gen).to(dtype) for _ in range(3))
    # One row with the key equal to the hidden row, one opposite: the gate near its two ends.
    key[0] = hidden[0]
    if rows > 1:
        key[1] = -hidden[1]
    w_h, w_k = (torch.rand(width, generator=gen).to(dtype) + 0.5 for _ in range(2))
    got = engram_gate(*(on_device(t) for t in (hidden, key, value, w_h, w_k)), 1e-6)
    ref = engram_gate_ref(hidden, key, value, w_h, w_k, 1e-6)
    _close(got, ref, dtype)
    # The reference is the model's formula.
    h = rms_norm_ref(hidden, w_h, 1e-6)[0].float()
    k = rms_norm_ref(key, w_k, 1e-6)[0].float()
    d = (h * k).sum(-1) / width**0.5
    gate = torch.sigmoid(torch.sign(d) * torch.sqrt(d.abs().clamp(min=1e-6)))
    assert torch.equal(ref, hidden + gate.to(dtype)[:, None] * value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(16, 4, 2), (128, 2, 1), (96, 3, 3)])
def test_rms_norm_heads_in_place_equals_slice_norm_concat(on_device, dtype, head_dim, heads, kv_heads):
    """The q/k norms of a fused projection in place: per head, and over the whole projection."""
    from raystate.kernels.norm import rms_norm_heads_, rms_norm_heads_ref

    gen = torch.Generator().manual_seed(head_dim + heads)
    tokens = 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    w = (torch.randn(head_dim, generator=gen) * 0.2).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    plain_q = rms_norm_ref(q.reshape(-1, head_dim), w, 1e-6, None, 1.0)[0].reshape(tokens, -1)
    want = torch.cat((plain_q, k, v), dim=-1)
    got = rms_norm_heads_(on_device(qkv.clone()), on_device(w), 1e-6, 1.0, 0, head_dim, heads)
    _close(got, want, dtype)
    assert torch.equal(rms_norm_heads_ref(qkv.clone(), w, 1e-6, 1.0, 0, head_dim, heads), want)
    # One span over the whole k projection (OLMo 3's norm).
    wk = torch.randn(kv_heads * head_dim, generator=gen).to(dtype)
    plain_k = rms_norm_ref(k, wk, 1e-6)[0]
    got = rms_norm_heads_(
        on_device(qkv.clone()), on_device(wk), 1e-6, 0.0, heads * head_dim, kv_heads * head_dim, 1
    )
    _close(got, torch.cat((q, plain_k, v), dim=-1), dtype)
