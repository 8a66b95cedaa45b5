"""lm-evaluation-harness run as its users run it, against a real `raystate serve` (opt-in).

Skipped unless `lm_eval` is importable (CI does not install it: `pip install "lm-eval[api]"`). The module
makes the tiny random Qwen3 checkpoint of tests/hfmodels (a real BPE tokenizer and chat template), starts
`raystate serve --backend inprocess` on it in a subprocess on a free loopback port, and runs the `lm_eval`
CLI (a subprocess, `--log_samples`) on the repo's tasks (evals/tasks/raystate_tiny) plus a
`loglikelihood` task written here whose continuations are the model's own greedy ones (so that `is_greedy`
is True for some requests, not only False as on the random-answer tasks):

- `local-completions` (echo + logprobs=1 + max_tokens=1 on /v1/completions, token-id prompts): each logged
  (loglikelihood, is_greedy) equals the offline one, `LLM(folder, backend="inprocess")` with prompt logprobs
  summed over the continuation tokens (lm-eval's split: encode(context + continuation) after
  encode(context)), within 1e-4; generate_until responses equal offline greedy text cut at the stop.
- `local-chat-completions --apply_chat_template`: each generate_until response equals `LLM.chat`'s greedy
  reply cut at the stop.

Both sides run the kernels' PyTorch references in float32 on the CPU. The server runs with
`--no-swa-bounded-replay` (SERVER_FLAGS): with bounded replay on (the default), a generation after a
prefix-cache hit longer than the 24-token window differs from the uncached run (first-token logprob -1.656
vs -1.941 on this model; BENCHMARKS.md, "lm-eval against the server"), so the generate_until comparisons
would fail.
Loglikelihood requests (echo + logprobs: prompt logprobs) are computed whole either way.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")  # lm-eval's API models need its [api] extra (tenacity, aiohttp, ...)

import httpx  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "evals" / "tasks"
TOL = 1e-4
SERVER_FLAGS = ["--no-swa-bounded-replay"]  # see the module docstring
MAX_GEN_TOKS = 16  # evals/tasks/raystate_tiny/raystate_tiny_gen.yaml
STOP = "\n"
GREEDY_PROMPTS = [
    "Question: What is the capital of France?\nAnswer:",
    "The quick brown fox",
    "Once upon a time",
    "1, 2, 3, 4,",
    "Hello, my name is",
    "In the beginning",
    "def main():",
    "The weather today is",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference_kernels():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAYSTATE_KERNELS", "reference")
        mp.setattr("raystate.kernels._common._reference_forced", True)
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    sys.path.insert(0, str(REPO / "tests" / "hfmodels"))
    from hf_families import make_family_checkpoint

    return make_family_checkpoint("qwen3", tmp_path_factory.mktemp("ckpt") / "qwen3")


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """`raystate serve` in a subprocess; yields its root URL. Ready once /v1/models answers (not /health:
    see BENCHMARKS.md, it answers 400 for a checkpoint without a BOS token)."""
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "RAYSTATE_KERNELS": "reference"}
    cmd = [
        sys.executable,
        "-m",
        "raystate",
        "serve",
        "--model",
        str(checkpoint),
        "--backend",
        "inprocess",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        "cpu",
        "--dtype",
        "float32",
        *SERVER_FLAGS,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"raystate serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"raystate serve not ready in 240 s:\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # drains, then stops the local Ray it started
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


@pytest.fixture(scope="module")
def llm(checkpoint, reference_kernels):
    from raystate import LLM

    # The oracle computes every prompt whole: no prefix caching.
    llm = LLM(
        str(checkpoint), backend="inprocess", device="cpu", dtype="float32", enable_prefix_caching=False
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(checkpoint))


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's causal split (TemplateLM._encode_pair): trailing spaces of the context move to the
    continuation; the continuation's ids are encode(context + continuation) after len(encode(context))."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx) :]


def _offline_loglikelihoods(llm, tokenizer, pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    from raystate import SamplingParams

    encoded = [_encode_pair(tokenizer, c, x) for c, x in pairs]
    outs = llm.generate(
        prompt_token_ids=[ctx + cont for ctx, cont in encoded],
        sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=1),
        use_tqdm=False,
    )
    res = []
    for (ctx, cont), out in zip(encoded, outs, strict=True):
        ids, plp = out.prompt_token_ids, out.prompt_logprobs
        assert ids == ctx + cont and len(ctx) > 0
        picked = [plp[i][ids[i]] for i in range(len(ctx), len(ids))]
        res.append((sum(p.logprob for p in picked), all(p.rank == 1 for p in picked)))
    return res


def _greedy_task(llm, tokenizer, folder: Path) -> Path:
    """A `loglikelihood` task whose continuations are the model's greedy 3 tokens, kept where lm-eval's
    re-encoding gives back the same ids (so is_greedy must come back True)."""
    from raystate import SamplingParams

    outs = llm.generate(GREEDY_PROMPTS, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    docs = []
    for prompt, out in zip(GREEDY_PROMPTS, outs, strict=True):
        cont = tokenizer.decode(out.token_ids)
        ctx_ids, cont_ids = _encode_pair(tokenizer, prompt, cont)
        if ctx_ids == out.prompt_token_ids and cont_ids == out.token_ids and cont.strip() == cont:
            docs.append({"context": prompt, "continuation": cont})
    assert docs, "no greedy continuation survives re-encoding"
    folder.mkdir(parents=True)
    data = folder / "greedy.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "raystate_tiny_greedy.yaml").write_text(
        "task: raystate_tiny_greedy\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
        "output_type: loglikelihood\n"
        "test_split: test\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_target: "{{continuation}}"\n'
        'target_delimiter: ""\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n"
    )
    return folder


def _lm_eval(args: list[str], out: Path, tmp: Path) -> dict[str, list[dict]]:
    """Runs the lm_eval CLI; returns each task's logged samples."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp / "hf_datasets"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [sys.executable, "-m", "lm_eval", *args, "--log_samples", "--output_path", str(out)]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"lm_eval failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    samples: dict[str, list[dict]] = {}
    for f in out.rglob("samples_*.jsonl"):
        task = f.name[len("samples_") :].rsplit("_", 1)[0]
        samples[task] = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return samples


def _ll_requests(samples: list[dict]) -> list[tuple[str, str, float, bool]]:
    """(context, continuation, loglikelihood, is_greedy) of every loglikelihood request of a task."""
    res = []
    for s in samples:
        args = [s["arguments"][k] for k in sorted(s["arguments"], key=lambda k: int(k.rsplit("_", 1)[1]))]
        for a, resp in zip(args, s["resps"], strict=True):
            ll, greedy = resp[0]
            res.append((a["arg_0"], a["arg_1"], float(ll), greedy in (True, "True")))
    return res


def test_local_completions_matches_offline(server, checkpoint, llm, tokenizer, tmp_path):
    tasks = tmp_path / "tasks"  # the repo's tasks and the greedy one (lm_eval takes one --include_path)
    shutil.copytree(TASKS, tasks, ignore=shutil.ignore_patterns("__pycache__"))
    _greedy_task(llm, tokenizer, tasks / "raystate_tiny_greedy")
    model_args = (
        f"model={checkpoint},base_url={server}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={checkpoint},max_retries=1"
    )
    t0 = time.monotonic()
    samples = _lm_eval(
        [
            "--model",
            "local-completions",
            "--model_args",
            model_args,
            "--tasks",
            "raystate_tiny_ll,raystate_tiny_gen,raystate_tiny_greedy",
            "--include_path",
            str(tasks),
        ],
        tmp_path / "out",
        tmp_path,
    )
    wall = time.monotonic() - t0
    assert set(samples) == {"raystate_tiny_ll", "raystate_tiny_gen", "raystate_tiny_greedy"}
    assert len(samples["raystate_tiny_ll"]) == 20 and len(samples["raystate_tiny_gen"]) == 20

    # loglikelihoods: every request of both loglikelihood tasks against the offline engine
    reqs = _ll_requests(samples["raystate_tiny_ll"]) + _ll_requests(samples["raystate_tiny_greedy"])
    assert len(reqs) == 80 + len(samples["raystate_tiny_greedy"])
    offline = _offline_loglikelihoods(llm, tokenizer, [(c, x) for c, x, _, _ in reqs])
    diffs = []
    for (ctx, cont, ll, greedy), (ll_ref, greedy_ref) in zip(reqs, offline, strict=True):
        assert math.isfinite(ll)
        diffs.append(abs(ll - ll_ref))
        assert abs(ll - ll_ref) <= TOL, (ctx, cont, ll, ll_ref)
        assert greedy == greedy_ref, (ctx, cont, greedy, greedy_ref)
    n_greedy = sum(g for _, _, _, g in reqs)
    assert n_greedy >= 1 and all(g for _, _, _, g in _ll_requests(samples["raystate_tiny_greedy"]))
    print(
        f"\n{len(reqs)} loglikelihood requests, max |diff| {max(diffs):.3g}, {n_greedy} greedy; "
        f"lm_eval wall {wall:.1f} s"
    )

    # generate_until: the server's greedy text up to the stop, as offline
    from raystate import SamplingParams

    gen = sorted(samples["raystate_tiny_gen"], key=lambda s: s["doc_id"])
    prompts = [s["arguments"]["gen_args_0"]["arg_0"] for s in gen]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_GEN_TOKS), use_tqdm=False)
    for s, out in zip(gen, outs, strict=True):
        assert s["resps"][0][0] == out.text.split(STOP)[0], (s["doc_id"], s["resps"][0][0], out.text)


def test_local_chat_completions_matches_offline(server, checkpoint, llm, tmp_path):
    from raystate import SamplingParams

    samples = _lm_eval(
        [
            "--model",
            "local-chat-completions",
            "--model_args",
            f"model={checkpoint},base_url={server}/v1/chat/completions,max_retries=1",
            "--apply_chat_template",
            "--tasks",
            "raystate_tiny_gen",
            "--include_path",
            str(TASKS),
        ],
        tmp_path / "out",
        tmp_path,
    )
    gen = sorted(samples["raystate_tiny_gen"], key=lambda s: s["doc_id"])
    assert len(gen) == 20
    convs = [json.loads(s["arguments"]["gen_args_0"]["arg_0"][0]) for s in gen]
    assert convs[0][-1]["role"] == "user"
    outs = llm.chat(convs, SamplingParams(max_tokens=MAX_GEN_TOKS), use_tqdm=False)
    for s, out in zip(gen, outs, strict=True):
        assert s["resps"][0][0] == out.text.split(STOP)[0], (s["doc_id"], s["resps"][0][0], out.text)
