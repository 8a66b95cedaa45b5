"""One set of engine knobs for every front end: `LLM(...)`, the Serve app's `AppArgs` and `raystate serve`'s
flags all come from `raystate.engine_args.EngineArgs`, with its defaults, through `build_engine_config`.
No Ray here: nothing is started."""

from __future__ import annotations

import dataclasses

import pytest

from raystate.cli import (
    AUTO_REPLICAS_GPU,
    AUTO_REPLICAS_MIN_CPUS,
    _engine_args,
    build_parser,
    ingress_replicas,
)
from raystate.engine_args import EngineArgs, build_engine_config, knobs
from raystate.errors import InvalidRequest
from raystate.serve.app import AppArgs

NON_DEFAULT = dict(
    block_size=8,
    max_num_batched_tokens=512,
    long_prefill_token_threshold=64,
    async_scheduling=False,
    max_model_len=256,
    max_num_seqs=4,
    enable_prefix_caching=False,
)


def test_every_front_end_has_every_knob_with_its_default():
    for knob in knobs():
        assert AppArgs.model_fields[knob.name].default == knob.default, knob.name
    assert AppArgs().engine_args() == EngineArgs()
    assert _engine_args(build_parser().parse_args(["serve"])) == EngineArgs()
    assert AppArgs().engine_config() == build_engine_config(EngineArgs())


def test_serve_args_and_flags_reach_the_config():
    want = build_engine_config(EngineArgs(**NON_DEFAULT))
    assert AppArgs(**NON_DEFAULT).engine_config() == want
    flags = ["serve", "--block-size", "8", "--max-num-batched-tokens", "512"]
    flags += ["--long-prefill-token-threshold", "64", "--no-async-scheduling", "--max-model-len", "256"]
    flags += ["--max-num-seqs", "4", "--no-enable-prefix-caching"]
    assert _engine_args(build_parser().parse_args(flags)) == EngineArgs(**NON_DEFAULT)
    assert want.cache.block_size == 8 and want.scheduler.long_prefill_token_threshold == 64
    assert want.max_model_len == 256 and not want.async_scheduling


def test_ingress_replicas_default_to_two_only_for_a_shared_gpu_engine_on_a_large_host():
    """--num-replicas unset: two replicas where one event loop would fall behind a GPU engine's streams
    (direct HTTP, the Ray backend's one engine, a CUDA device, enough CPUs); one everywhere else; and
    whatever the flag says when it is given."""
    many = AUTO_REPLICAS_MIN_CPUS
    assert build_parser().parse_args(["serve"]).num_replicas is None
    assert ingress_replicas(None, True, "cuda", "ray", many) == AUTO_REPLICAS_GPU == 2
    assert ingress_replicas(None, True, "cuda:1", "ray", 64) == AUTO_REPLICAS_GPU
    assert ingress_replicas(None, True, "cpu", "ray", many) == 1  # dev.py run, the CPU suite
    assert ingress_replicas(None, False, "cuda", "ray", many) == 1  # through Serve's proxy
    assert ingress_replicas(None, True, "cuda", "inprocess", many) == 1  # an engine per replica
    assert ingress_replicas(None, True, "cuda", "ray", many - 1) == 1
    assert ingress_replicas(None, True, "cuda", "ray", None) == 1  # os.cpu_count() unknown
    assert ingress_replicas(3, False, "cpu", "inprocess", 2) == 3
    assert build_parser().parse_args(["serve", "--num-replicas", "1"]).num_replicas == 1


def test_kv_cache_gib_flag_is_kv_cache_bytes():
    args = _engine_args(build_parser().parse_args(["serve", "--kv-cache-gib", "0.5"]))
    assert args == dataclasses.replace(EngineArgs(), kv_cache_bytes=1 << 29)


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("block_size", 3, "a power of two <= 128"),
        ("max_num_batched_tokens", 0, ">= 1"),
        ("long_prefill_token_threshold", -1, ">= 0"),
        ("max_num_seqs", 0, ">= 1"),
        ("kv_cache_bytes", 0, "> 0"),
        ("max_model_len", 1, ">= 2"),
        ("dtype", "fp8", "one of auto"),
    ],
)
def test_bad_values_name_the_field_and_the_limit(field, value, limit):
    with pytest.raises(InvalidRequest, match=limit) as err:
        AppArgs(**{field: value}).engine_config()
    assert err.value.field == field


def test_backend_is_ray_or_inprocess():
    assert AppArgs(backend="inprocess").backend == "inprocess"
    with pytest.raises(ValueError, match="inprocess"):
        AppArgs(backend="local")


@pytest.mark.parametrize(
    ("field", "value", "limit"),
    [
        ("max_num_seqs", "8", "of type int"),
        ("max_num_seqs", 8.0, "of type int"),
        ("max_num_seqs", True, "of type int"),
        ("num_blocks", "x", "of type int or None"),
        ("gpu_memory_utilization", "0.5", "of type float or None"),
        ("cuda_graphs", 1, "of type bool"),
        ("device", 0, "of type str"),
    ],
)
def test_a_knob_of_the_wrong_type_names_the_field_through_the_python_api(field, value, limit):
    # The Python API has no schema in front of it (the CLI's flags and the Serve args type-check first):
    # a wrong type is refused by name, not a TypeError from a range check.
    with pytest.raises(InvalidRequest, match=limit) as err:
        EngineArgs.from_kwargs(**{field: value})
    assert err.value.field == field


def test_the_python_api_takes_numbers_of_any_integral_or_real_type():
    import numpy as np

    args = EngineArgs.from_kwargs(
        max_num_seqs=np.int64(8), gpu_memory_utilization=1, num_blocks=None, device="cuda"
    )
    config = build_engine_config(args)  # nothing is allocated: the device is not touched
    assert config.scheduler.max_num_seqs == 8 and config.cache.gpu_memory_utilization == 1


def test_an_unknown_knob_is_refused_with_the_list_of_knobs():
    with pytest.raises(InvalidRequest, match="an engine knob .*max_num_seqs") as err:
        EngineArgs.from_kwargs(max_num_seq=8)
    assert err.value.field == "max_num_seq"


@pytest.mark.parametrize(
    ("options", "limit"),
    [
        ({"dispatch": "grpc"}, "'compiled' or 'actor'"),
        ({"pipeline_steps": "yes"}, "of type bool"),
        ({"pipline_steps": True}, "a launch option .*pipeline_steps"),
        ({"num_shards": 2}, "set by cluster_name and num_shards"),
    ],
)
def test_bad_ray_options_are_refused_when_the_app_args_are_read(options, limit):
    with pytest.raises(ValueError, match="ray_options") as err:
        AppArgs(ray_options=options)
    assert err.match(limit)


def test_ray_options_need_the_ray_backend():
    """The in-process engine starts no actors: launch options given to it would be dropped unread."""
    with pytest.raises(ValueError, match="ray_options: must be none with backend inprocess"):
        AppArgs(backend="inprocess", ray_options={"pipeline_steps": True})
    assert AppArgs(backend="inprocess").ray_options == {}


def test_serve_reads_the_chat_template_flag_before_ray_starts(capsys):
    """--chat-template: a file or the template text; a name that is neither is refused by name, before
    any Ray starts (the tests of the template itself: tests/hfmodels/test_hf_serving.py)."""
    assert build_parser().parse_args(["serve", "--chat-template", "t.jinja"]).chat_template == "t.jinja"
    from raystate.cli import main

    assert main(["serve", "--chat-template", "no-such-template.jinja"]) == 2
    err = capsys.readouterr().err
    assert "chat_template: must be a template file or Jinja template text" in err


def test_the_ray_options_flag_is_the_apps_ray_options():
    flags = ["serve", "--ray-options", '{"pipeline_steps": true, "step_timeout_s": 60}']
    assert build_parser().parse_args(flags).ray_options == {"pipeline_steps": True, "step_timeout_s": 60}
    assert build_parser().parse_args(["serve"]).ray_options == {}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("{pipeline_steps: true}", "--ray-options: not JSON"),
        ('["pipeline_steps"]', "--ray-options: a JSON object of launch options, not list"),
    ],
)
def test_a_ray_options_flag_that_is_not_a_json_object_is_a_usage_error(value, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--ray-options", value])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--ray-options", '{"pipline_steps": true}'], "ray_options: pipline_steps: must be a launch option"),
        (["--ray-options", '{"step_timeout_s": "x"}'], "ray_options: step_timeout_s: must be of type float"),
        (["--backend", "inprocess", "--ray-options", '{"pipeline_steps": true}'], "none with backend"),
    ],
)
def test_serve_refuses_bad_ray_options_by_name_before_ray_starts(flags, says, capsys):
    """Checked where the app's args are read, before any Ray starts: the error is the field and the
    limit on one line, without pydantic's echo of the input."""
    from raystate.cli import main

    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raystate: error: ") and says in err
    assert "validation error" not in err and "pydantic" not in err and err.count("\n") == 1
