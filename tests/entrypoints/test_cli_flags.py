"""Every LLM(...) option has a command-line flag (except a short, documented exclusion list),
and the parsed values reach the engine's config."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.llm_engine import LLMEngine
from hybridkv.entrypoints import LLM
from hybridkv.entrypoints.cli import (
    CLI_EXCLUDED_LLM_KWARGS, SERVE_TARGET_STEP_SECONDS, build_parser, engine_kwargs, main,
    max_queued_requests, serve_engine_kwargs, server_settings,
)
from hybridkv.entrypoints.openai.api_server import API_KEY_ENV, ServerSettings


def _llm_keywords() -> list[str]:
    return [n for n in inspect.signature(LLM.__init__).parameters if n != "self"]


def _flags(subcommand: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[subcommand]
    return {s for a in sub._actions for s in a.option_strings}


@pytest.mark.parametrize("subcommand", ["generate", "serve"])
def test_every_llm_keyword_has_a_flag(subcommand):
    flags = _flags(subcommand)
    missing = [
        n for n in _llm_keywords()
        if n not in CLI_EXCLUDED_LLM_KWARGS and "--" + n.replace("_", "-") not in flags
    ]
    assert not missing, f"LLM(...) keywords without a `hybridkv {subcommand}` flag: {missing}"
    # Security default: pickled weights can run code, so no flag turns them on.
    assert "--allow-pickle-weights" not in flags


def test_exclusions_are_real_keywords():
    assert CLI_EXCLUDED_LLM_KWARGS <= set(_llm_keywords())


def test_defaults_match_llm_defaults():
    args = build_parser().parse_args(["generate"])
    kwargs = engine_kwargs(args)
    params = inspect.signature(LLM.__init__).parameters
    for name, value in kwargs.items():
        assert value == params[name].default, name
    assert kwargs["block_size"] is None  # the model's default page size


ARGV = [
    "--dtype", "float32", "--max-model-len", "96", "--block-size", "32", "--max-num-seqs", "3",
    "--max-num-batched-tokens", "80", "--no-enable-prefix-caching", "--seed", "5",
    "--kv-cache-memory-bytes", str(4 << 20), "--scheduling-policy", "lpm", "--eviction-policy", "lfu",
    "--no-windowed-match", "--attention-backend", "torch_native", "--num-threads", "1",
]
EXPECTED = dict(
    dtype="float32", max_model_len=96, block_size=32, max_num_seqs=3, max_num_batched_tokens=80,
    enable_prefix_caching=False, seed=5, kv_cache_memory_bytes=4 << 20, scheduling_policy="lpm",
    eviction_policy="lfu", windowed_match=False, num_threads=1,
)


def test_parsed_values_reach_the_engine_config(tiny_ckpt, monkeypatch, capsys):
    """`hybridkv generate` with every engine flag set: the engine is built from exactly those values."""
    configs: list[EngineConfig] = []
    original = LLMEngine.__init__

    def recording_init(self, config: EngineConfig) -> None:
        configs.append(config)
        original(self, config)

    monkeypatch.setattr(LLMEngine, "__init__", recording_init)
    path = tiny_ckpt("llama")
    threads = torch.get_num_threads()  # --num-threads sets torch's process-wide count
    try:
        assert main(["generate", "the quick brown", "--model", path, "--max-tokens", "2", *ARGV]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    (config,) = configs
    assert config.model == path
    for name, value in EXPECTED.items():
        assert getattr(config, name) == value, name
    if "attention_backend" in {f.name for f in dataclasses.fields(EngineConfig)}:
        assert config.attention_backend == "torch_native"
    assert "### the quick brown" in capsys.readouterr().out


def test_every_flag_set_reaches_the_serve_config():
    """serve builds an EngineConfig from the same engine_kwargs."""
    args = build_parser().parse_args(["serve", "some/model", *ARGV])
    config = EngineConfig(model=args.model_tag, **engine_kwargs(args))
    for name, value in EXPECTED.items():
        assert getattr(config, name) == value, name


def test_chat_template_file_is_read(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    args = build_parser().parse_args(["generate", "--chat-template", str(template)])
    assert engine_kwargs(args)["chat_template"] == "{{ messages[0]['content'] }}"


def test_unknown_policy_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--scheduling-policy", "random"])
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("text, size", [("2147483648", 2 << 30), ("64MiB", 64 << 20), ("1.5GiB", 3 << 29),
                                        ("500MB", 500 * 10**6), ("2G", 2 * 10**9), ("4 kib", 4096)])
def test_byte_sizes_take_units(text, size):
    args = build_parser().parse_args(["generate", "--kv-cache-memory-bytes", text, "--hicache-size", text])
    assert args.kv_cache_memory_bytes == size and args.hicache_size == size


@pytest.mark.parametrize("text", ["lots", "64 parsecs", "-5", ""])
def test_a_byte_size_without_a_number_and_unit_is_refused_naming_the_form(text, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-cache-memory-bytes", text])
    assert "expected bytes, e.g. 2147483648, 2GiB or 512MiB" in capsys.readouterr().err


SERVE_ARGV = [
    "--keepalive-timeout", "3.5", "--body-timeout", "7", "--max-connections", "9", "--max-seqs-per-request", "11",
    "--max-queued-requests", "13", "--metrics-require-api-key", "--max-request-body-bytes", "4096", "--api-key", "k",
]


def test_serve_defaults_are_the_server_settings_defaults(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = build_parser().parse_args(["serve"])
    settings, default = server_settings(args, None), ServerSettings()
    for f in dataclasses.fields(ServerSettings):
        assert getattr(settings, f.name) == getattr(default, f.name), f.name
    assert max_queued_requests(args) == 2048


def test_serve_flags_reach_the_server_settings():
    args = build_parser().parse_args(["serve", *SERVE_ARGV])
    s = server_settings(args, None)
    assert (s.keepalive_timeout, s.body_timeout, s.max_connections, s.max_seqs_per_request) == (3.5, 7.0, 9, 11)
    assert s.metrics_require_api_key and s.max_request_body_bytes == 4096 and s.api_key == "k"
    assert max_queued_requests(args) == 13
    assert max_queued_requests(build_parser().parse_args(["serve", "--max-queued-requests", "0"])) is None


@pytest.mark.parametrize("flag, value", [("--body-timeout", "0"), ("--keepalive-timeout", "-1"),
                                         ("--max-connections", "0"), ("--max-seqs-per-request", "0"),
                                         ("--max-queued-requests", "-1")])
def test_serve_refuses_bad_limits_before_loading_a_model(flag, value, capsys):
    assert main(["serve", "/no/such/model", flag, value]) == 2
    err = capsys.readouterr().err
    assert flag.lstrip("-").replace("-", "_") in err.replace("-", "_") and "/no/such/model" not in err


def test_serve_defaults_to_the_auto_step_target():
    parse = build_parser().parse_args
    kw = serve_engine_kwargs(parse(["serve"]))
    assert (kw["target_step_seconds"], kw["max_step_seconds"]) == (SERVE_TARGET_STEP_SECONDS, None) == ("auto", None)
    assert serve_engine_kwargs(parse(["serve", "--max-step-seconds", "0.3"]))["max_step_seconds"] == 0.3
    # An explicit target without a longest step holds every step to that target, as before.
    kw = serve_engine_kwargs(parse(["serve", "--target-step-seconds", "0.5"]))
    assert (kw["target_step_seconds"], kw["max_step_seconds"]) == (0.5, None)
    kw = serve_engine_kwargs(parse(["serve", "--target-step-seconds", "0"]))
    assert (kw["target_step_seconds"], kw["max_step_seconds"]) == (None, None)
    assert engine_kwargs(parse(["generate", "--target-step-seconds", "auto"]))["target_step_seconds"] == "auto"
    with pytest.raises(ValueError, match="max_step_seconds"):
        EngineConfig(model="m", **serve_engine_kwargs(parse(["serve", "--max-step-seconds", "-1"])))
    with pytest.raises(SystemExit):
        parse(["serve", "--target-step-seconds", "soon"])

def test_serve_prefaults_the_kv_cache_and_generate_takes_it_lazily():
    parse = build_parser().parse_args
    assert serve_engine_kwargs(parse(["serve"]))["kv_cache_prefault"] is True
    assert serve_engine_kwargs(parse(["serve", "--no-kv-cache-prefault"]))["kv_cache_prefault"] is False
    assert engine_kwargs(parse(["generate"]))["kv_cache_prefault"] is None  # LLM's default: lazy
    assert engine_kwargs(parse(["generate", "--kv-cache-prefault"]))["kv_cache_prefault"] is True


def test_fleet_passes_what_follows_the_double_dash_to_every_replica(monkeypatch):
    """`hybridkv fleet MODEL --replicas 3 -- --max-model-len 8`: the fleet's own flags before `--`,
    every replica's `serve` flags after it (argparse alone would let the model swallow them)."""
    from hybridkv.entrypoints import cli

    seen = []
    monkeypatch.setattr(cli, "_fleet", lambda a: seen.append((a.model_tag, a.replicas, a.serve_args)) or 0)
    assert cli.main(["fleet", "m", "--replicas", "3", "--", "--max-model-len", "8"]) == 0
    assert cli.main(["fleet", "--replicas", "2", "--", "--dtype", "float32"]) == 0
    assert cli.main(["fleet", "m"]) == 0
    assert seen == [("m", 3, ["--max-model-len", "8"]), (None, 2, ["--dtype", "float32"]), ("m", 2, [])]


@pytest.mark.parametrize("subcommand", ["generate", "serve"])
def test_expert_parallelism_flag_reaches_the_engine_config(subcommand):
    argv = [subcommand, "some/model", "--tensor-parallel-size", "2", "--enable-expert-parallel"]
    if subcommand == "generate":
        argv = ["generate", "a prompt", "--model", "some/model", *argv[2:]]
    args = build_parser().parse_args(argv)
    kwargs = engine_kwargs(args) if subcommand == "generate" else serve_engine_kwargs(args)
    config = EngineConfig(model="some/model", **kwargs)
    assert (config.tensor_parallel_size, config.enable_expert_parallel) == (2, True)
