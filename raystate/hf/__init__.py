"""Hugging Face checkpoints' text side: tokenizer, chat template, stream detokenization, generation defaults.

Built on `tokenizers` and `jinja2` only (no transformers, so no torch): the serving layer may import it.
"""

from raystate.hf.chat_template import ChatTemplateError
from raystate.hf.detokenize import HFTextStream, IncrementalDetokenizer
from raystate.hf.generation_config import GenerationDefaults, load_generation_defaults
from raystate.hf.tokenizer import HFTokenizer

__all__ = [
    "ChatTemplateError",
    "GenerationDefaults",
    "HFTextStream",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "load_generation_defaults",
]
