"""No request can hurt another (issue 13, point 1): tiny temperatures are greedy, a request whose logits go
non-finite ends alone with finish_reason "error" (on the eager path and on the decode-graph path), a bad
value that reaches the worker fails its request alone, and the engine keeps serving with every KV block
back in its pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raystate import LLM, SamplingParams
from raystate.messages import NewRequest, StepMessage, ids_to_bytes
from raystate.messages import SamplingParams as WireParams

MAX_TOKENS = 10


def _prompts(seed: int, num: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, int(rng.integers(12, 40))).tolist() for _ in range(num)]


def _free_blocks(llm) -> list[int]:
    return llm.engine.scheduler.stats().num_free_blocks[0]


def test_tiny_temperatures_are_greedy(make_llm):
    """temperature 5e-324 (and 1e-38) once killed the shard: "probability tensor contains inf/nan"."""
    llm, _ = make_llm()
    prompts = _prompts(1, 4)
    greedy = llm.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False
    )
    tiny = [SamplingParams(max_tokens=MAX_TOKENS, temperature=t) for t in (5e-324, 1e-38, 1e-7, 0.0)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=tiny, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in greedy]
    assert all(o.finish_reason in ("stop", "length") and o.error is None for o in outs)


@pytest.mark.parametrize(
    "path",
    [
        "eager",
        "decode_graph",
        pytest.param("cuda_graph", marks=[pytest.mark.gpu, pytest.mark.triton_kernels]),
    ],
)
def test_non_finite_logits_fail_one_request_alone(make_llm, path):
    """Token X's embedding is made NaN, X being a token the victim generates at its 3rd step and no other
    request ever reads: the victim's next step has NaN logits (a decode step: on the graph path when that
    is on; on a GPU, a captured graph), it ends with "error", and the others' tokens equal a clean run's,
    also on KV blocks the victim left behind."""
    if path == "cuda_graph":
        llm = LLM(
            model="tiny",
            backend="inprocess",
            device="cuda",
            dtype="float32",
            max_model_len=256,
            max_num_seqs=8,
            num_blocks=129,  # sized, not from the GPU the test processes share
        )
        assert llm.engine.worker.graphs is not None
    else:
        llm, _ = make_llm(max_num_seqs=8)
    worker = llm.engine.worker
    exact = path != "cuda_graph"
    if path == "decode_graph":
        worker.graphs = worker.new_decode_graphs()  # never captured: replay runs the graph's step eagerly
    if path != "eager":
        worker.logit_recorder = None  # (a recorder keeps steps off the graph path)
    prompts = _prompts(2, 6)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    clean = [
        o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    ]
    free_before = _free_blocks(llm)
    # The victim: the first prompt whose third generated token no other prompt or output contains.
    victim, poison = None, None
    for v in range(len(prompts)):
        x = clean[v][2]
        others = {t for i in range(len(prompts)) if i != v for t in prompts[i] + clean[i]}
        if x not in others and x not in prompts[v] and x not in clean[v][:2]:
            victim, poison = v, x
            break
    assert victim is not None, "no token to poison: change the prompts' seed"
    with torch.no_grad():
        worker.model.embed.weight[poison] = float("nan")
    graph_steps = (
        (lambda: worker.graphs.num_eager_steps + worker.graphs.num_replays) if worker.graphs else None
    )
    steps_before = graph_steps() if graph_steps else 0
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    bad = outs[victim]
    assert bad.finish_reason == "error" and "non-finite logits" in bad.error
    assert bad.token_ids == clean[victim][:3]  # X itself was sampled fine; the step reading it failed
    for i, o in enumerate(outs):
        if i != victim:
            assert o.finish_reason == "length" and len(o.token_ids) == MAX_TOKENS
            # The same batches up to the victim's failure; after it, only the CPU is batch invariant.
            assert o.token_ids == clean[i] if exact else o.token_ids[:3] == clean[i][:3]
    if graph_steps:
        assert graph_steps() > steps_before  # the decode steps really took the graph path
    # The engine serves on, on the blocks the victim freed (stale NaN KV must not leak into others).
    again = llm.generate(
        prompt_token_ids=prompts[:victim] + prompts[victim + 1 :], sampling_params=params, use_tqdm=False
    )
    assert all(o.finish_reason == "length" and o.error is None for o in again)
    if exact:
        assert [o.token_ids for o in again] == clean[:victim] + clean[victim + 1 :]
    llm.engine.scheduler.check_integrity()
    assert _free_blocks(llm) == free_before


def test_a_bad_value_reaching_the_worker_fails_that_request_alone(make_llm):
    """The worker refuses a NewRequest with an out-of-vocabulary token id (it would index the embedding
    out of bounds; on CUDA that takes the device context down) and answers FAILED_ROW for its row."""
    llm, _ = make_llm()
    worker = llm.engine.worker
    vocab = worker.model.config.vocab_size
    sampling = WireParams(max_tokens=4)

    def new(req_id: str, ids: list[int], num_scheduled: int) -> NewRequest:
        blocks = [[1 + 8 * g + i for i in range(2)] for g in range(len(worker.groups))]
        return NewRequest(req_id, ids_to_bytes(ids), len(ids), 0, 0, blocks, num_scheduled, sampling)

    good = new("good", [5, 6, 7], 3)
    bad = new("bad", [5, vocab + 7, 7], 3)
    unscheduled = new("later", [1, 2, -3], 0)
    result = worker.execute(StepMessage(step_id=1, new_requests=[bad, good, unscheduled]))
    assert result.req_ids == ["bad", "good"]
    sampled = np.frombuffer(result.sampled, dtype="<i4").tolist()
    assert sampled[0] == -2 and 0 <= sampled[1] < vocab
    assert "token ids must be in" in result.errors["bad"] and list(result.errors) == ["bad"]
    # The unscheduled refused request's later rows also answer FAILED_ROW, until it is finished.
    from raystate.messages import RunningDelta

    step2 = StepMessage(
        step_id=2,
        running=[
            RunningDelta("later", [[] for _ in worker.groups], 3),
            RunningDelta("good", [[] for _ in worker.groups], 1),
        ],
    )
    result = worker.execute(step2)
    assert np.frombuffer(result.sampled, dtype="<i4")[0] == -2 and "later" in result.errors
    worker.execute(StepMessage(step_id=3, finished_ids=["later", "bad", "good"]))
    assert not worker._refused and worker.num_active() == 0
