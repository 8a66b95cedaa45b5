"""raystate: a serving layer for hybrid-attention LLMs (engram lookback + SWA bounded replay).

Light on import: configs and wire types only. `LLM` and `RequestOutput` load on first use, so that
`import raystate.scheduler` (which runs this file) never pulls in torch.
"""

from raystate.beam_search import BeamSearchParams
from raystate.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from raystate.errors import InvalidRequest
from raystate.messages import SamplingParams

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CacheConfig",
    "EngineConfig",
    "InvalidRequest",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "SchedulerConfig",
]

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        from raystate import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'raystate' has no attribute {name!r}")
