"""`raystate.LLM`: offline batch generation, the programmatic entry point.

    llm = LLM(model="tiny")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=16))

Arguments mirror what a vLLM user expects; they are validated once here into a frozen `EngineConfig`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tqdm import tqdm

from raystate.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from raystate.errors import InvalidRequest
from raystate.messages import SamplingParams
from raystate.tokenizer import ByteTokenizer


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0  # the prefix-cache hit h in tokens, 0 when none was used
    replay_start: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _model_config(model: str, max_model_len: int | None) -> tuple[ModelConfig, str | None]:
    """A named config ("tiny", "bench") or a save_pretrained directory."""
    import os

    if os.path.isfile(os.path.join(model, "config.json")):
        import json

        with open(os.path.join(model, "config.json")) as f:
            cfg = ModelConfig.from_dict(json.load(f))
        path: str | None = model
    else:
        cfg = ModelConfig.named(model)
        path = None
    if max_model_len is not None:
        cfg = ModelConfig.from_dict({**cfg.to_dict(), "max_model_len": max_model_len})
    return cfg, path


class LLM:
    def __init__(
        self,
        model: str = "tiny",
        device: str = "cpu",
        enable_prefix_caching: bool = True,
        swa_bounded_replay: bool = True,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        long_prefill_token_threshold: int = 0,
        seed: int = 0,
        max_model_len: int | None = None,
        dtype: str = "auto",
        cuda_graphs: bool = True,
        backend: str = "inprocess",
    ) -> None:
        model_cfg, path = _model_config(model, max_model_len)
        self.config = EngineConfig(
            model=model_cfg,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=num_blocks,
                enable_prefix_caching=enable_prefix_caching,
                swa_bounded_replay=swa_bounded_replay,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                long_prefill_token_threshold=long_prefill_token_threshold,
            ),
            device=device,
            dtype=dtype,
            cuda_graphs=cuda_graphs,
            seed=seed,
            model_path=path,
        )
        self.tokenizer = ByteTokenizer()
        if backend != "inprocess":
            raise InvalidRequest("backend", "'inprocess'", backend)
        from raystate.engine import InProcessEngine

        self.engine = InProcessEngine(self.config)
        self._ids = itertools.count()

    def _prompts(self, prompts, prompt_token_ids) -> list[tuple[str | None, list[int]]]:
        if prompts is not None and prompt_token_ids is not None:
            raise InvalidRequest("prompts", "given alone (not with prompt_token_ids)", "both")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            return [(p, self.tokenizer.encode(p)) for p in prompts]
        if prompt_token_ids is None:
            raise InvalidRequest("prompts", "a string, a list of strings or prompt_token_ids", None)
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            prompt_token_ids = [prompt_token_ids]
        return [(None, list(ids)) for ids in prompt_token_ids]

    def generate(
        self,
        prompts: str | list[str] | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in prompt order.

        A bad prompt raises InvalidRequest (a ValueError) naming the field and the limit; the call's other
        prompts are withdrawn and requests accepted before the call are not touched.
        """
        if isinstance(prompt_token_ids, SamplingParams) or (
            isinstance(prompt_token_ids, list)
            and prompt_token_ids
            and isinstance(prompt_token_ids[0], SamplingParams)
        ):
            # generate(prompts, params), the vLLM call shape.
            if sampling_params is not None:
                raise InvalidRequest("sampling_params", "given once", "twice")
            prompt_token_ids, sampling_params = None, prompt_token_ids
        items = self._prompts(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise InvalidRequest("sampling_params", f"one per prompt ({len(items)})", len(params))
        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        for (text, ids), sp in zip(items, params, strict=True):
            rid = f"req-{next(self._ids)}"
            try:
                self.engine.add_request(rid, ids, sp)
            except ValueError:
                # Withdraw this call's earlier prompts; requests accepted before the call run on.
                for queued in order:
                    self.engine.abort(queued)
                raise
            outputs[rid] = RequestOutput(request_id=rid, prompt=text, prompt_token_ids=ids)
            order.append(rid)
        bar = tqdm(total=len(order), desc="generate", disable=not use_tqdm or len(order) < 2)
        pending = set(order)
        while pending:
            for u in self.engine.step():
                out = outputs.get(u.req_id)
                if out is None:
                    continue
                out.token_ids.extend(u.new_token_ids)
                out.num_cached_tokens = u.num_cached_tokens
                out.replay_start = u.replay_start
                if u.finished:
                    out.finish_reason = u.finish_reason
                    pending.discard(u.req_id)
                    bar.update(1)
        bar.close()
        for out in outputs.values():
            out.text = self.tokenizer.decode(out.token_ids)
        return [outputs[r] for r in order]
