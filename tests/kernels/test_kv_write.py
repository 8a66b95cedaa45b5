"""write_kv against its reference, bit for bit, with the slots of negative entries left untouched."""

import pytest
import torch

from raystate.kernels import PAD_SLOT_ID, write_kv, write_kv_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, so comparisons are bitwise (signed zeros and all)."""
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _run_both(on_device, key, value, k_cache, v_cache, slot_mapping):
    """Runs the launcher on device copies and the reference on CPU clones; returns both cache pairs."""
    k_dev, v_dev = on_device(k_cache), on_device(v_cache)
    write_kv(on_device(key), on_device(value), k_dev, v_dev, on_device(slot_mapping))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, k_ref, v_ref, slot_mapping)
    return (k_dev.cpu(), v_dev.cpu()), (k_ref, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(3))
def test_random_writes_match_reference_and_skip_negative_slots(on_device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    for num_heads, head_dim in ((1, 1), (3, 5), (2, 16)):
        num_blocks, block_size = 5, 4
        num_tokens = int(torch.randint(1, num_blocks * block_size, (1,), generator=gen))
        # Key and value are slices of one fused projection, so their token stride exceeds H * D.
        fused = torch.randn(num_tokens, 3, num_heads, head_dim, generator=gen).to(dtype)
        key, value = fused[:, 1], fused[:, 2]
        # Both caches are views into one [2, ...] buffer full of garbage that must survive where not written.
        kv = torch.randn(2, num_blocks, block_size, num_heads, head_dim, generator=gen).to(dtype)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[: num_tokens + 3]
        skipped = torch.rand(num_tokens + 3, generator=gen) < 0.3
        slot_mapping = torch.where(skipped, torch.full_like(slots, PAD_SLOT_ID), slots).long()
        # Slice on the device too, so the kernel sees the strided views themselves.
        fused_dev, kv_dev = on_device(fused), on_device(kv)
        write_kv(fused_dev[:, 1], fused_dev[:, 2], kv_dev[0], kv_dev[1], on_device(slot_mapping))
        k_got, v_got = kv_dev[0].cpu(), kv_dev[1].cpu()
        k_ref, v_ref = kv[0].clone(), kv[1].clone()
        write_kv_ref(key, value, k_ref, v_ref, slot_mapping)
        assert torch.equal(_bits(k_got), _bits(k_ref))
        assert torch.equal(_bits(v_got), _bits(v_ref))

        # Every slot not named by a kept token's entry (negative ones, the tail past T) keeps its bits.
        written = slot_mapping[:num_tokens][slot_mapping[:num_tokens] >= 0]
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
        untouched[written] = False
        for got, before in ((k_got, kv[0]), (v_got, kv[1])):
            flat_got = got.reshape(-1, num_heads, head_dim)
            flat_before = before.reshape(-1, num_heads, head_dim)
            assert torch.equal(_bits(flat_got[untouched]), _bits(flat_before[untouched]))
        flat_k = k_got.reshape(-1, num_heads, head_dim)
        kept = slot_mapping[:num_tokens] >= 0
        assert torch.equal(_bits(flat_k[written]), _bits(key[kept]))


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_fp32_inputs_are_cast_to_the_cache_dtype(on_device, cache_dtype):
    gen = torch.Generator().manual_seed(11)
    # Values representable in the cache dtype, so the cast is exact whatever rounding mode runs
    # (Triton's interpreter truncates fp32 -> bf16 where a GPU rounds to nearest even).
    key = torch.randn(6, 2, 8, generator=gen).to(cache_dtype).float()
    value = torch.randn(6, 2, 8, generator=gen).to(cache_dtype).float()
    k_cache = torch.zeros(2, 4, 2, 8, dtype=cache_dtype)
    v_cache = torch.zeros(2, 4, 2, 8, dtype=cache_dtype)
    slot_mapping = torch.tensor([7, 0, -1, 3, 5, -1], dtype=torch.int64)
    (k_got, v_got), (k_ref, v_ref) = _run_both(on_device, key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(_bits(k_got), _bits(k_ref))
    assert torch.equal(_bits(v_got), _bits(v_ref))
    assert torch.equal(k_got.view(-1, 2, 8)[7], key[0].to(cache_dtype))


def test_no_tokens_and_all_skipped_leave_the_cache_alone(on_device):
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(3, 4, 2, 4, generator=gen)
    v_cache = torch.randn(3, 4, 2, 4, generator=gen)
    empty = torch.zeros(0, 2, 4)
    (k_got, v_got), _ = _run_both(
        on_device, empty, empty, k_cache, v_cache, torch.zeros(4, dtype=torch.int64)
    )
    assert torch.equal(_bits(k_got), _bits(k_cache)) and torch.equal(_bits(v_got), _bits(v_cache))

    key = torch.randn(5, 2, 4, generator=gen)
    slot_mapping = torch.full((5,), PAD_SLOT_ID, dtype=torch.int64)
    (k_got, v_got), _ = _run_both(on_device, key, key, k_cache, v_cache, slot_mapping)
    assert torch.equal(_bits(k_got), _bits(k_cache)) and torch.equal(_bits(v_got), _bits(v_cache))


@pytest.mark.gpu
def test_no_host_sync():
    key = torch.randn(6, 2, 8, device="cuda", dtype=torch.bfloat16)
    k_cache = torch.zeros(2, 4, 2, 8, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    slot_mapping = torch.tensor([7, 0, -1, 3, 5, -1], dtype=torch.int64, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        write_kv(key, key, k_cache, v_cache, slot_mapping)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(k_cache.view(-1, 2, 8)[slot_mapping[slot_mapping >= 0]], key[slot_mapping >= 0])
