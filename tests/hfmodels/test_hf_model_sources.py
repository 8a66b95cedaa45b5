"""`revision`, `tokenizer`, `tokenizer_revision` and `generation_config`: a hub id at a branch, tag or
commit, a tokenizer given apart from the checkpoint (a folder, or a hub id), and the default sampling
fields taken from the checkpoint, from nowhere or from another folder, through `LLM`, the Serve app's
config and `raystate serve`'s flags. The hub is offline and its cache private (`offline_hub`): a cached
snapshot is what a download would have left."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers
from hf_families import make_family_checkpoint
from huggingface_hub import constants
from tokenizers import AddedToken, Tokenizer

from raystate import LLM, SamplingParams
from raystate.cli import _engine_args, build_parser
from raystate.engine_args import EngineArgs, build_engine_config, resolve_model
from raystate.errors import InvalidRequest
from raystate.serve.text import model_text_for_config

MAIN = "0" * 40
V2 = "2" * 40
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
TOKENIZER_FILES += ("chat_template.jinja",)
CHAT = [{"role": "user", "content": "Hello world, café?"}]


@pytest.fixture
def offline_hub(tmp_path, monkeypatch) -> Path:
    """An empty private HF cache with the hub offline; returns the hub cache folder."""
    cache = tmp_path / "hf_home" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(cache.parent))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HOME", str(cache.parent))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _cache_snapshot(cache: Path, repo_id: str, ref: str, commit: str, source: Path) -> Path:
    """Puts the files of `source` into the hub cache as `repo_id` at `commit`, with `ref` naming it."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    return snapshot


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_family_checkpoint("llama", tmp_path_factory.mktemp("hf_rev") / "llama")


@pytest.fixture(scope="module")
def weights_only(llama, tmp_path_factory) -> Path:
    """The llama checkpoint without its tokenizer files (as a repo that keeps them elsewhere)."""
    folder = tmp_path_factory.mktemp("hf_rev") / "weights_only"
    shutil.copytree(llama, folder)
    for name in TOKENIZER_FILES:
        (folder / name).unlink(missing_ok=True)
    return folder


def _with_max_len(source: Path, dest: Path, max_len: int) -> Path:
    shutil.copytree(source, dest)
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": max_len}))
    return dest


def test_revision_picks_the_snapshot_of_a_hub_id(offline_hub, llama, tmp_path):
    """main and the tag v2 hold checkpoints that differ in max_position_embeddings: the revision knob picks
    one, from LLM-style kwargs and from `raystate serve --revision` alike."""
    repo = "someorg/tiny-llama"
    _cache_snapshot(offline_hub, repo, "main", MAIN, _with_max_len(llama, tmp_path / "a", 320))
    _cache_snapshot(offline_hub, repo, "v2", V2, _with_max_len(llama, tmp_path / "b", 448))
    assert build_engine_config(EngineArgs(model="someorg/tiny-llama")).max_model_len == 320
    config = build_engine_config(EngineArgs(model="someorg/tiny-llama", revision="v2"))
    assert config.max_model_len == 448 and V2 in config.model_path
    from types import SimpleNamespace

    from raystate.serve.server import RaystateServer

    (card,) = RaystateServer(SimpleNamespace(config=config)).models().data  # vLLM's root: the hub id
    assert (card.id, card.root, card.max_model_len) == ("someorg/tiny-llama", "someorg/tiny-llama", 448)
    flags = build_parser().parse_args(["serve", "--model", "someorg/tiny-llama", "--revision", V2])
    assert build_engine_config(_engine_args(flags)).max_model_len == 448
    with pytest.raises(InvalidRequest, match="revision 'v3'") as e:
        resolve_model("someorg/tiny-llama", revision="v3")  # offline, not cached: says which revision
    assert e.value.field == "model"


def test_revision_is_refused_where_it_means_nothing(llama):
    for model in ("tiny", str(llama)):
        with pytest.raises(InvalidRequest, match="not a hub id") as e:
            resolve_model(model, revision="v2")
        assert e.value.field == "revision"


def test_tokenizer_apart_from_the_checkpoint(llama, weights_only):
    """A checkpoint without tokenizer files is refused naming tokenizer.json; with `tokenizer` it encodes,
    decodes and renders chats with that tokenizer's files, in LLM and in the Serve app's text side."""
    with pytest.raises(InvalidRequest, match="tokenizer.json"):
        LLM(str(weights_only), backend="inprocess")
    tok = transformers.AutoTokenizer.from_pretrained(str(llama))
    llm = LLM(str(weights_only), tokenizer=str(llama), backend="inprocess", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    (out,) = llm.generate(["Hello world, this is"], params, use_tqdm=False)
    assert out.prompt_token_ids == tok("Hello world, this is")["input_ids"]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    (chat,) = llm.chat(CHAT, params, use_tqdm=False)
    assert chat.prompt == tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    # the same weights with their own tokenizer: the same tokens
    (own,) = LLM(str(llama), backend="inprocess", enable_prefix_caching=False).generate(
        ["Hello world, this is"], params, use_tqdm=False
    )
    assert own.token_ids == out.token_ids

    config = build_engine_config(EngineArgs(model=str(weights_only), tokenizer=str(llama)))
    assert config.model_path == str(weights_only) and config.tokenizer_path == str(llama)
    text = model_text_for_config(config)  # what the Serve ingress builds from the backend's config
    assert text.encode("café naïve") == tok("café naïve")["input_ids"]
    assert text.chat_prompt(CHAT)[0] == chat.prompt
    assert build_engine_config(EngineArgs(model=str(llama))).tokenizer_path is None  # its own


def test_structured_output_compiles_against_the_given_tokenizer(llama, weights_only):
    """The worker's grammar is built from the tokenizer given apart (the checkpoint has none)."""
    schema = {"type": "object", "properties": {"a": {"enum": ["yes", "no"]}}, "required": ["a"]}
    schema["additionalProperties"] = False
    llm = LLM(str(weights_only), tokenizer=str(llama), backend="inprocess", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=48, json_schema=json.dumps(schema))
    (out,) = llm.generate(["Is it?"], params, use_tqdm=False)
    assert out.finish_reason == "stop", (out.finish_reason, out.error, out.text)
    assert json.loads(out.text) in ({"a": "yes"}, {"a": "no"})


def test_tokenizer_from_the_hub_at_a_revision(offline_hub, llama, weights_only):
    _cache_snapshot(offline_hub, "someorg/tok", "v1", V2, llama)
    llm_args = EngineArgs(model=str(weights_only), tokenizer="someorg/tok", tokenizer_revision="v1")
    config = build_engine_config(llm_args)
    assert V2 in config.tokenizer_path
    tok = transformers.AutoTokenizer.from_pretrained(str(llama))
    assert model_text_for_config(config).encode("Hello") == tok("Hello")["input_ids"]
    with pytest.raises(InvalidRequest, match="offline") as e:
        resolve_model(str(weights_only), tokenizer="someorg/tok")  # main is not cached
    assert e.value.field == "tokenizer"


def test_tokenizer_errors_name_the_field(llama, weights_only, tmp_path):
    with pytest.raises(InvalidRequest, match="reads bytes") as e:
        resolve_model("tiny", tokenizer=str(llama))
    assert e.value.field == "tokenizer"
    with pytest.raises(InvalidRequest, match="holding tokenizer.json") as e:
        resolve_model(str(llama), tokenizer=str(weights_only))
    assert e.value.field == "tokenizer"
    with pytest.raises(InvalidRequest, match="not a hub id") as e:
        resolve_model(str(llama), tokenizer=str(llama), tokenizer_revision="v1")
    assert e.value.field == "tokenizer_revision"
    with pytest.raises(InvalidRequest, match="no tokenizer is given") as e:
        resolve_model(str(llama), tokenizer_revision="v1")
    assert e.value.field == "tokenizer_revision"
    # a tokenizer with ids past the model's vocabulary (its embedding has no row for them)
    big = tmp_path / "big_tokenizer"
    big.mkdir()
    backend = Tokenizer.from_file(str(llama / "tokenizer.json"))
    backend.add_tokens([AddedToken(f"<extra_{i}>") for i in range(3)])
    backend.save(str(big / "tokenizer.json"))
    vocab = json.loads((llama / "config.json").read_text())["vocab_size"]
    with pytest.raises(InvalidRequest, match=f"at most {vocab} ids") as e:
        LLM(str(weights_only), tokenizer=str(big), backend="inprocess")
    assert e.value.field == "tokenizer"
    from raystate.serve.app import AppArgs, build_app

    with pytest.raises(InvalidRequest, match=f"at most {vocab} ids"):  # where the Serve config is read
        build_app(AppArgs(model=str(weights_only), tokenizer=str(big), backend="inprocess"))


def _eos_ids(llama: Path) -> tuple[list[int], list[int]]:
    """(config.json's EOS ids, generation_config.json's) of the llama checkpoint."""

    def ids(v):
        return v if isinstance(v, list) else [v]

    config = json.loads((llama / "config.json").read_text())
    generation = json.loads((llama / "generation_config.json").read_text())
    return ids(config["eos_token_id"]), ids(generation["eos_token_id"])


def test_generation_config_vllm_drops_the_checkpoint_defaults_but_not_its_eos(llama):
    """vLLM's `--generation-config vllm`: requests that leave a field out get OpenAI's default, not the
    checkpoint's (llama's file sets temperature 0.6, top_p 0.9); its EOS ids still end requests."""
    auto = LLM(str(llama), backend="inprocess")
    assert auto.get_default_sampling_params().temperature == 0.6
    plain = LLM(str(llama), backend="inprocess", generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    assert plain.config.model.eos_token_ids == auto.config.model.eos_token_ids
    assert len(auto.config.model.eos_token_ids) == 2  # <|end_of_text|> and <|eot_id|>
    flags = build_parser().parse_args(["serve", "--model", str(llama), "--generation-config", "vllm"])
    config = build_engine_config(_engine_args(flags))
    assert config.generation_config == "vllm"
    assert model_text_for_config(config).sampling_defaults() == {}  # what the Serve ingress applies


def test_generation_config_from_another_folder(llama, tmp_path):
    """A folder's generation_config.json gives the defaults and the EOS ids in place of the checkpoint's."""
    config_eos, file_eos = _eos_ids(llama)
    other = tmp_path / "gen"
    other.mkdir()
    extra = max(config_eos + file_eos) + 1
    (other / "generation_config.json").write_text(
        json.dumps({"temperature": 0.3, "top_k": 7, "eos_token_id": [config_eos[0], extra]})
    )
    llm = LLM(str(llama), backend="inprocess", generation_config=str(other))
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.3, 7, 1.0)
    assert list(llm.config.model.eos_token_ids) == [*config_eos, extra]
    config = build_engine_config(EngineArgs(model=str(llama), generation_config=str(other)))
    assert config.generation_config == str(other)
    assert model_text_for_config(config).sampling_defaults() == {"temperature": 0.3, "top_k": 7}


def test_generation_config_errors_name_the_field(llama, tmp_path):
    with pytest.raises(InvalidRequest, match="has no generation_config.json") as e:
        resolve_model("tiny", generation_config="vllm")
    assert e.value.field == "generation_config"
    with pytest.raises(InvalidRequest, match="auto, vllm or a folder holding generation_config.json") as e:
        resolve_model(str(llama), generation_config=str(tmp_path))
    assert e.value.field == "generation_config"


def test_a_node_without_the_hub_snapshot_finds_its_own_copy(
    offline_hub, llama, weights_only, tmp_path, monkeypatch
):
    """The config carries where a hub snapshot came from ("org/name@commit"), so a worker or replica on a
    node where the resolving node's folder does not exist takes (or downloads) its own copy at the same
    commit; a node whose cache lacks it too (and is offline) says so, naming the model."""
    import dataclasses

    from raystate.engine_args import with_local_checkpoint
    from raystate.worker.worker import Worker

    _cache_snapshot(offline_hub, "someorg/tiny-llama", "main", MAIN, weights_only)
    _cache_snapshot(offline_hub, "someorg/tok", "main", V2, llama)
    args = EngineArgs(model="someorg/tiny-llama", tokenizer="someorg/tok", enable_prefix_caching=False)
    config = build_engine_config(args)
    assert config.model_hub == f"someorg/tiny-llama@{MAIN}" and config.tokenizer_hub == f"someorg/tok@{V2}"
    assert with_local_checkpoint(config) is config  # the folders exist here: nothing to do
    elsewhere = dataclasses.replace(
        config, model_path=f"/other/node/snapshots/{MAIN}", tokenizer_path=f"/other/node/snapshots/{V2}"
    )
    local = with_local_checkpoint(elsewhere)
    assert (local.model_path, local.tokenizer_path) == (config.model_path, config.tokenizer_path)
    worker = Worker(elsewhere)  # loads the weights from this node's copy
    assert worker.config.model_path == config.model_path
    tok = transformers.AutoTokenizer.from_pretrained(str(llama))
    assert model_text_for_config(elsewhere).encode("Hello") == tok("Hello")["input_ids"]
    # a local folder is taken as given (the user's folder must be on every node)
    assert build_engine_config(EngineArgs(model=str(llama))).model_hub is None

    empty = tmp_path / "other_cache"
    empty.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(empty))
    with pytest.raises(InvalidRequest, match="someorg/tiny-llama") as e:
        with_local_checkpoint(elsewhere)
    assert e.value.field == "model"


def test_max_model_len_past_the_checkpoint_s_positions_needs_the_env(llama, monkeypatch):
    """As vLLM: a longer max_model_len than max_position_embeddings (4096 here) would run positions the
    model was not trained for, so it is refused by name unless RAYSTATE_ALLOW_LONG_MAX_MODEL_LEN=1."""
    assert build_engine_config(EngineArgs(model=str(llama), max_model_len=4096)).max_model_len == 4096
    with pytest.raises(InvalidRequest, match="<= 4096, the checkpoint's max_position_embeddings") as e:
        build_engine_config(EngineArgs(model=str(llama), max_model_len=8192))
    assert e.value.field == "max_model_len"
    monkeypatch.setenv("RAYSTATE_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert build_engine_config(EngineArgs(model=str(llama), max_model_len=8192)).max_model_len == 8192
    monkeypatch.delenv("RAYSTATE_ALLOW_LONG_MAX_MODEL_LEN")
    longer = 2 * build_engine_config(EngineArgs(model="tiny")).max_model_len  # our models: no such limit
    assert build_engine_config(EngineArgs(max_model_len=longer)).max_model_len == longer
