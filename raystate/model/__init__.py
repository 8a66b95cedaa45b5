"""raystate.model: the reference hybrid transformer, its weights and its dense test oracles.

Imports torch and raystate.kernels; never ray, the scheduler or message types.
"""

from raystate.model.attention import Attention, ForwardMetadata, GroupMetadata
from raystate.model.decoder_lm import DecoderLM
from raystate.model.engram import (
    Engram,
    EngramHashConstants,
    compressed_vocab_from_tokenizer,
    engram_hash_constants,
    engram_normalize,
)
from raystate.model.reference import dense_attention, dense_forward, replay_reference
from raystate.model.transformer import DecoderLayer, TinyHybrid
from raystate.model.weights import empty_model, init_weights, is_model_dir, load_model, save_pretrained

__all__ = [
    "Attention",
    "DecoderLM",
    "DecoderLayer",
    "Engram",
    "EngramHashConstants",
    "ForwardMetadata",
    "GroupMetadata",
    "TinyHybrid",
    "compressed_vocab_from_tokenizer",
    "dense_attention",
    "dense_forward",
    "empty_model",
    "engram_hash_constants",
    "engram_normalize",
    "init_weights",
    "is_model_dir",
    "load_model",
    "replay_reference",
    "save_pretrained",
]
