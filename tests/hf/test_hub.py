"""`resolve_checkpoint_folder`: local folders, hub ids, and the offline / cached-copy cases.

Every test runs with the hub forced offline and an empty, private HF cache (the `offline_cache` fixture
is autouse), so nothing here can reach the network or read the user's cache. huggingface_hub reads
HF_HUB_OFFLINE and HF_HUB_CACHE into `huggingface_hub.constants` at import time, so the fixture patches
those constants as well as the environment. Hub failures that need a server (a missing repo, a gated
one, a dropped connection) are simulated by replacing `snapshot_download`.
"""

from __future__ import annotations

from pathlib import Path

import httpx2
import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub import errors as hub_errors

from raystate.errors import InvalidRequest
from raystate.hf.hub import ModelNotAvailable, looks_like_hub_id, resolve_checkpoint_folder

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(autouse=True)
def offline_cache(tmp_path, monkeypatch) -> Path:
    """An empty HF_HOME under tmp_path with the hub offline; returns the hub cache folder."""
    home = tmp_path / "hf_home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def _cached_repo(cache: Path, repo_id: str, files: dict[str, str]) -> Path:
    """huggingface_hub's cache layout for one model repo at COMMIT, with `main` pointing at it:
    models--{org}--{name}/refs/main holds the commit; snapshots/{commit}/ holds the files."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def _http_error(cls, status: int):
    request = httpx2.Request("GET", "https://huggingface.co/api/models/someorg/somemodel")
    return cls("hub said no", response=httpx2.Response(status, request=request))


# ----------------------------------------------------------------------------------------------------------
# Local folders and words that are not hub ids


def test_local_folder_with_config(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_checkpoint_folder(str(folder)) == folder


def test_local_folder_without_config(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    with pytest.raises(InvalidRequest, match="config.json") as err:
        resolve_checkpoint_folder(str(folder))
    assert str(folder) in str(err.value)


def test_local_file_is_not_a_folder(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(InvalidRequest, match="is a file"):
        resolve_checkpoint_folder(str(file))


@pytest.mark.parametrize(
    "word", ["not a/valid//id", "a/b/c", "-bad", "org/name-", "a--b", "x..y", "r.git", ""]
)
def test_not_a_path_nor_a_hub_id(word, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("must not reach snapshot_download")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", never)
    assert not looks_like_hub_id(word)
    with pytest.raises(InvalidRequest, match="hub id"):
        resolve_checkpoint_folder(word)


@pytest.mark.parametrize("word", ["./missing", "../missing", "/no/such/folder", "~/no-such-folder-here"])
def test_missing_path_is_not_tried_on_the_hub(word):
    assert not looks_like_hub_id(word)
    with pytest.raises(InvalidRequest, match="no such folder"):
        resolve_checkpoint_folder(word)


@pytest.mark.parametrize("word", ["gpt2", "someorg/somemodel", "Qwen/Qwen3-0.6B", "meta-llama/Llama-3.1-8B"])
def test_hub_ids(word):
    assert looks_like_hub_id(word)


def test_existing_relative_path_is_not_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not looks_like_hub_id("org/name")


# ----------------------------------------------------------------------------------------------------------
# Hub ids, offline


def test_offline_without_cached_copy(offline_cache):
    with pytest.raises(ModelNotAvailable) as err:
        resolve_checkpoint_folder("someorg/somemodel")
    msg = str(err.value)
    assert "'someorg/somemodel'" in msg
    assert "not a local folder" in msg
    assert str(offline_cache) in msg
    assert "could not be reached" in msg and "HF_HUB_OFFLINE" in msg
    assert isinstance(err.value, InvalidRequest) and err.value.field == "model"


def test_offline_with_cached_copy(offline_cache):
    snapshot = _cached_repo(offline_cache, "someorg/somemodel", {"config.json": "{}", "tokenizer.json": "{}"})
    folder = resolve_checkpoint_folder("someorg/somemodel")
    assert Path(folder).resolve() == snapshot.resolve()
    assert (folder / "config.json").is_file()


def test_offline_cached_copy_by_commit(offline_cache):
    snapshot = _cached_repo(offline_cache, "someorg/somemodel", {"config.json": "{}"})
    assert resolve_checkpoint_folder("someorg/somemodel", revision=COMMIT).resolve() == snapshot.resolve()


def test_offline_unknown_revision_is_named(offline_cache):
    _cached_repo(offline_cache, "someorg/somemodel", {"config.json": "{}"})
    with pytest.raises(ModelNotAvailable, match="revision 'v2'"):
        resolve_checkpoint_folder("someorg/somemodel", revision="v2")


def test_cached_copy_without_config(offline_cache):
    _cached_repo(offline_cache, "someorg/somemodel", {"tokenizer.json": "{}"})
    with pytest.raises(InvalidRequest, match="config.json"):
        resolve_checkpoint_folder("someorg/somemodel")


# ----------------------------------------------------------------------------------------------------------
# Hub failures (simulated: no network here)


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (lambda: _http_error(hub_errors.RepositoryNotFoundError, 404), "not found"),
        (lambda: _http_error(hub_errors.GatedRepoError, 403), "gated"),
    ],
)
def test_missing_or_gated_repo_is_named(monkeypatch, error, words):
    def fail(*args, **kwargs):
        raise error()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(InvalidRequest, match=words) as err:
        resolve_checkpoint_folder("someorg/somemodel")
    assert "someorg/somemodel" in str(err.value)


def test_unreachable_hub_when_online(monkeypatch, offline_cache):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    def fail(*args, **kwargs):
        raise hub_errors.LocalEntryNotFoundError("cannot find the snapshot") from httpx2.ConnectError("down")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fail)
    with pytest.raises(ModelNotAvailable, match=r"could not be reached \(ConnectError\)") as err:
        resolve_checkpoint_folder("someorg/somemodel")
    assert str(offline_cache) in str(err.value)


def test_download_gets_only_what_serving_needs(monkeypatch, tmp_path):
    seen = {}
    folder = tmp_path / "snap"
    folder.mkdir()
    (folder / "config.json").write_text("{}")

    def fake(repo_id, **kwargs):
        seen.update(kwargs, repo_id=repo_id)
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_checkpoint_folder("someorg/somemodel", revision="main") == folder
    assert seen["repo_id"] == "someorg/somemodel" and seen["revision"] == "main"
    assert "*.safetensors" in seen["allow_patterns"] and "config.json" in seen["allow_patterns"]
    assert "additional_chat_templates/*.jinja" in seen["allow_patterns"]  # the tokenizer reads them
    assert not any(p.endswith(".bin") for p in seen["allow_patterns"])
