"""Triton kernels with plain PyTorch references, imported as `raystate.kernels`.

Each launcher runs its Triton kernel on CUDA tensors (or on the CPU under TRITON_INTERPRET=1) and its
reference otherwise. Kernels import torch, triton and numpy only.
"""

from raystate.kernels._common import PAD_SLOT_ID, cdiv, next_pow2, use_triton
from raystate.kernels.attention import paged_attention, paged_attention_ref
from raystate.kernels.engram_hash import engram_hash, engram_hash_ref, engram_hash_scalar
from raystate.kernels.lookback import gather_lookback, gather_lookback_ref
from raystate.kernels.slot_mapping import (
    compute_slot_mappings,
    compute_slot_mappings_ref,
    pad_replayed_slots,
    pad_replayed_slots_ref,
)

__all__ = [
    "PAD_SLOT_ID",
    "cdiv",
    "compute_slot_mappings",
    "compute_slot_mappings_ref",
    "engram_hash",
    "engram_hash_ref",
    "engram_hash_scalar",
    "gather_lookback",
    "gather_lookback_ref",
    "next_pow2",
    "paged_attention",
    "paged_attention_ref",
    "pad_replayed_slots",
    "pad_replayed_slots_ref",
    "use_triton",
]
