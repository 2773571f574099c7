"""`pcr-rag serve`'s command line: every `EngineConfig` / `ServerSettings` field is a flag (generated, so none can be
missed), older and vLLM names parse, a TOML config file sits under the command line, the remote secret comes only
from a private file (or the environment), and a bad value stops the command with status 2 before a model loads."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

import pcr_rag.engine
from pcr_rag import cli as top_cli
from pcr_rag.config import EngineConfig
from pcr_rag.errors import ConfigError
from pcr_rag.server import cli
from pcr_rag.server.flags import add_flag, dataclass_flags, field_docs, from_table, given, read_secret_file
from pcr_rag.server.settings import ServerSettings

SECRET = "0123456789abcdef-shared-by-replicas"


@pytest.fixture(autouse=True)
def _no_secrets_in_the_environment(monkeypatch):
    monkeypatch.delenv("PCR_RAG_REMOTE_SECRET", raising=False)
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pcr-rag serve")
    cli.add_arguments(p)
    return p


def configs(argv: list[str], environ: dict[str, str] | None = None) -> cli.ServeConfig:
    return cli.serve_config(parser().parse_args(argv), environ={} if environ is None else environ)


def private_file(path: Path, text: str, mode: int = 0o600) -> Path:
    path.write_text(text)
    path.chmod(mode)
    return path


def test_every_engine_and_server_field_has_a_flag():
    """Fails when a field is added to a dataclass the command line does not cover (fields are introspected)."""
    actions = {a.dest: a for a in parser()._actions}
    for section, cls in (("engine", EngineConfig), ("server", ServerSettings), ("serve", cli.ServeOptions)):
        for f in (f for f in dataclasses.fields(cls) if f.init):  # what the constructor takes
            action = actions.get(f"{section}.{f.name}")
            assert action is not None, f"{cls.__name__}.{f.name} has no pcr-rag serve flag"
            assert action.option_strings, f.name
    # the secret has a file flag and no value flag (a value would show in ps)
    assert actions["engine.remote_secret"].option_strings == ["--remote-secret-file"]
    options = {o for a in parser()._actions for o in a.option_strings}
    assert "--remote-secret" not in {o for a in parser()._actions if a.dest == "engine.remote_secret"
                                     for o in a.option_strings}
    assert {"--remote-url", "--device-capacity", "--remote-insecure", "--no-remote-encrypt"} <= options


def test_every_field_is_documented_in_its_docstring():
    """The flags' help is the dataclasses' documentation: a field without a docstring entry has no --help text."""
    for cls, undocumented in ((EngineConfig, {"extra"}), (ServerSettings, set()), (cli.ServeOptions, set())):
        missing = {f.name for f in dataclasses.fields(cls)} - set(field_docs(cls)) - undocumented
        assert not missing, f"document {sorted(missing)} in {cls.__name__}'s docstring"


def test_docstring_entries_name_fields_and_continue_on_deeper_lines():
    docs = field_docs(EngineConfig)
    assert docs["ssd_capacity"] == docs["device_capacity"] and "ssd_capacity=0 disables" in docs["ssd_capacity"]
    assert docs["remote_timeout_s"].startswith("bound every connect")
    assert "padding rows" in docs["max_active"]  # a continuation line
    assert field_docs(ServerSettings)["port"].startswith("where to listen")


def test_a_full_command_line_builds_the_engine_and_server_configs(tmp_path):
    secret = private_file(tmp_path / "secret", SECRET + "\n")
    argv = ["--model", "tiny", "--cache-dir", str(tmp_path / "kv"), "--chunk-size", "16", "--dram-capacity", "64MiB",
            "--ssd-capacity", "0", "--device-capacity", "1GiB", "--device", "cpu", "--dtype", "float32",
            "--prefetch-window", "2", "--no-layerwise", "--no-prefetch", "--eviction", "lru", "--namespace", "t1",
            "--max-new-tokens", "9", "--announce-ttl-s", "7.5", "--max-queue", "11", "--max-active", "3",
            "--max-model-len", "none", "--prefill-chunk-tokens", "64", "--itl-budget-steps", "none",
            "--schedule", "fcfs", "--weights", "int8", "--no-warmup", "--no-freeze-gc", "--io-workers", "1",
            "--model-cache-dir", str(tmp_path / "models"), "--extra", "a=1", "--extra", "b=x=y",
            "--remote-url", "redis://cache:6379/0", "--remote-capacity", "2GiB", "--remote-ttl-s", "60",
            "--remote-namespace", "ns", "--remote-connect-timeout-s", "0.5", "--remote-timeout-s", "2",
            "--remote-breaker-errors", "5", "--remote-breaker-backoff-s", "3", "--remote-write-queue", "8",
            "--remote-secret-file", str(secret), "--remote-encrypt", "--ssd-encrypt",
            "--host", "0.0.0.0", "--port", "9001", "--api-keys", "k1", "--api-keys", "k2", "--tenant-per-key",
            "--served-model-name", "m", "--shutdown-timeout-s", "4", "--max-body-bytes", "2MiB",
            "--max-tickets", "7", "--log-level", "debug"]
    config = configs(argv, environ={cli.API_KEY_ENV: "ignored"})
    e, s = config.engine, config.server
    assert (e.cache_dir, e.chunk_size, e.dram_capacity, e.ssd_capacity, e.device_capacity) == (
        tmp_path / "kv", 16, 64 * 2**20, 0, 2**30)
    assert (e.device, e.dtype, e.prefetch_window, e.layerwise, e.prefetch, e.eviction, e.namespace) == (
        "cpu", "float32", 2, False, False, "lru", "t1")
    assert (e.max_new_tokens, e.announce_ttl_s, e.max_queue, e.max_active, e.max_model_len) == (9, 7.5, 11, 3, None)
    assert (e.prefill_chunk_tokens, e.itl_budget_steps, e.schedule, e.weights, e.warmup, e.freeze_gc) == (
        64, None, "fcfs", "int8", False, False)
    assert (e.io_workers, e.model_cache_dir, e.extra) == (1, str(tmp_path / "models"), {"a": 1, "b": "x=y"})
    assert (e.remote_url, e.remote_capacity, e.remote_ttl_s, e.remote_namespace) == (
        "redis://cache:6379/0", 2**30 * 2, 60.0, "ns")
    assert (e.remote_connect_timeout_s, e.remote_timeout_s, e.remote_breaker_errors, e.remote_breaker_backoff_s,
            e.remote_write_queue) == (0.5, 2.0, 5, 3.0, 8)
    assert (e.remote_secret, e.remote_encrypt, e.ssd_encrypt, e.remote_insecure) == (SECRET, True, True, False)
    assert SECRET not in repr(e)
    assert (s.host, s.port, s.api_keys, s.tenant_per_key, s.served_model_name) == (
        "0.0.0.0", 9001, ("k1", "k2"), True, "m")
    assert (s.shutdown_timeout_s, s.max_body_bytes, s.max_tickets) == (4.0, 2 * 2**20, 7)
    assert config.options == cli.ServeOptions(model="tiny", log_level="debug")


def test_defaults_are_the_dataclasses_except_serves_own():
    config = configs([])
    assert config.engine.freeze_gc is True  # serve owns its process
    expected = EngineConfig(freeze_gc=True)
    for f in dataclasses.fields(EngineConfig):
        assert getattr(config.engine, f.name) == getattr(expected, f.name), f.name
    assert config.server == ServerSettings()
    assert config.options == cli.ServeOptions()


def test_older_flag_names_still_parse():
    """The command lines of tests/server/test_processes.py and pcr_rag.bench.server_proc, and the old spellings."""
    argv = ["--model", "/m", "--port", "8123", "--cache-dir", "/tmp/kv", "--chunk-size", "16", "--dram", "64MiB",
            "--ssd", "64MiB", "--max-new-tokens", "8", "--max-model-len", "1024", "--max-active", "4",
            "--dtype", "float32", "--shutdown-timeout", "2.5", "--log-level", "warning", "--weights", "int4",
            "--no-cache", "--api-key", "a", "--api-key", " b ", "--tenant-per-key", "--served-model-name", "x",
            "--max-body-bytes", "1MiB", "--max-queue", "5", "--device", "cpu", "--host", "127.0.0.2"]
    config = configs(argv)
    e, s = config.engine, config.server
    assert (e.dram_capacity, e.ssd_capacity, e.enable_cache, e.weights, e.max_active) == (
        64 * 2**20, 64 * 2**20, False, "int4", 4)
    assert (s.shutdown_timeout_s, s.api_keys, s.tenant_per_key, s.max_body_bytes, s.port, s.host) == (
        2.5, ("a", "b"), True, 2**20, 8123, "127.0.0.2")
    assert config.options.log_level == "warning"


def test_vllm_names_are_aliases():
    config = configs(["--max-num-seqs", "6", "--quantization", "int8", "--no-enable-prefix-caching",
                      "--download-dir", "/models", "--uvicorn-log-level", "error", "--max-model-len", "512"])
    assert (config.engine.max_active, config.engine.weights, config.engine.enable_cache,
            config.engine.model_cache_dir, config.engine.max_model_len) == (6, "int8", False, "/models", 512)
    assert config.options.log_level == "error"


def test_api_keys_come_from_the_flags_else_the_environment():
    assert configs([], environ={cli.API_KEY_ENV: "k1, k2,,"}).server.api_keys == ("k1", "k2")
    assert configs(["--api-key", "k3"], environ={cli.API_KEY_ENV: "k1"}).server.api_keys == ("k3",)


@pytest.mark.parametrize("argv, want", [
    (["--chat-template-kwargs", "enable_thinking=false"], {"enable_thinking": False}),  # the boolean, not "false"
    (["--chat-template-kwargs", '{"enable_thinking": false, "depth": 2}'], {"enable_thinking": False, "depth": 2}),
    (["--chat-template-kwargs", "tags=[\"a\", 1]", "--chat-template-kwargs", "name=Ada",
      "--chat-template-kwargs", "quoted=\"2\""], {"tags": ["a", 1], "name": "Ada", "quoted": "2"}),
    (["--chat-template-kwargs", '{"a": 1, "b": 2}', "--chat-template-kwargs", "b=null"], {"a": 1, "b": None}),
])
def test_dict_flags_read_json_values_as_vllm_does(argv, want):
    """``enable_thinking=false`` as the string "false" would be true in the template's ``if``: values are JSON."""
    assert configs(argv).engine.chat_template_kwargs == want


@pytest.mark.parametrize("argv, message", [
    (["--port", "http"], "expected an integer"),
    (["--dram", "lots"], "not a byte size"),
    (["--itl-budget-steps", "nan"], "finite"),
    (["--shutdown-timeout", "inf"], "finite"),
    (["--schedule", "random"], "expected one of fcfs, cache-aware"),
    (["--eviction", "mru"], "expected one of lookahead-lru, lru"),
    (["--log-level", "loud"], "expected one of critical"),
    (["--extra", "novalue"], "KEY=VALUE"),
    (["--chat-template-kwargs", "enable_thinking=False"], "write JSON's false"),
    (["--chat-template-kwargs", "x=None"], "write JSON's null"),
    (["--chat-template-kwargs", '{"enable_thinking": fals}'], "expected a JSON object or KEY=VALUE"),
    (["--chat-template-kwargs", "{" * 100_000], "expected a JSON object or KEY=VALUE"),  # too deep: no crash
    (["--remote-secret", "s3cret-on-the-command-line"], "--remote-secret is not accepted"),
    (["--remote-secret=s3cret-on-the-command-line"], "pass --remote-secret-file PATH"),
    (["--remote-sec", "/run/secret"], "unrecognized arguments"),  # no abbreviations
    (["--max-body", "1MiB"], "unrecognized arguments"),
])
def test_a_value_argparse_cannot_convert_exits_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "s3cret-on-the-command-line" not in err


class _NoModel:
    def __init__(self, *args, **kwargs):
        raise AssertionError("a model was loaded despite a bad setting")


@pytest.mark.parametrize("argv, message", [
    (["--chunk-size", "0"], "chunk_size must be an int >= 1"),
    (["--port", "70000"], "port must be in [0, 65535]"),
    (["--tenant-per-key"], "tenant_per_key needs at least one API key"),
    (["--max-body-bytes", "10"], "max_body_bytes must be"),
    (["--remote-url", "ftp://cache", "--remote-insecure"], "remote tier"),
    (["--remote-url", "redis://cache:6379/0"], "a remote tier needs a secret"),
    (["--remote-url", "redis://cache:6379/0", "--remote-secret-file", "{short}"], "at least 16 characters"),
])
def test_a_value_its_dataclass_refuses_exits_2_before_the_model_loads(argv, message, monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(pcr_rag.engine, "PCREngine", _NoModel)
    short = private_file(tmp_path / "short", "too-short\n")
    assert top_cli.main(["serve", *(a.format(short=short) for a in argv)]) == 2
    assert message in caplog.text
    assert "too-short" not in caplog.text


def test_remote_url_and_secret_file_configure_the_remote_tier(tmp_path):
    secret = private_file(tmp_path / "secret", SECRET + "\r\n")
    config = configs(["--remote-url", "valkey://cache:6379/0", "--remote-secret-file", str(secret)])
    assert config.engine.remote_url == "valkey://cache:6379/0"
    assert config.engine.remote_secret == SECRET  # the trailing newline dropped
    assert config.engine.remote_config is not None


def test_without_a_secret_file_the_engine_reads_the_environment(monkeypatch):
    with pytest.raises(ConfigError, match="needs a secret"):
        configs(["--remote-url", "valkey://cache:6379/0"])
    monkeypatch.setenv("PCR_RAG_REMOTE_SECRET", SECRET)
    engine = configs(["--remote-url", "valkey://cache:6379/0"]).engine
    assert (engine.remote_secret, engine.secret) == (None, SECRET)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_secret_file_others_can_access_is_refused(tmp_path, mode, capsys):
    secret = private_file(tmp_path / "secret", SECRET, mode)
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(["--remote-secret-file", str(secret)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"mode {mode:04o}" in err and f"chmod 600 {secret}" in err
    assert SECRET not in err


def test_a_secret_file_that_is_missing_empty_or_not_a_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cannot read secret file"):
        read_secret_file(tmp_path / "absent")
    with pytest.raises(ValueError, match="is empty"):
        read_secret_file(private_file(tmp_path / "empty", "\n"))
    with pytest.raises(ValueError, match="not a regular file"):
        read_secret_file(tmp_path)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_in_place_of_the_secret_file_is_refused_without_hanging(tmp_path):
    fifo = tmp_path / "secret"
    os.mkfifo(fifo, 0o600)
    outcome: list[BaseException] = []
    worker = threading.Thread(target=lambda: outcome.append(_raises(read_secret_file, fifo)), daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "reading a FIFO blocked"
    assert "not a regular file" in str(outcome[0])


def _raises(fn, *args) -> BaseException:
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread
        return exc
    raise AssertionError("no error")


def write_config(path: Path, text: str, mode: int = 0o644) -> str:
    return str(private_file(path, text, mode))


def test_a_config_file_sits_between_the_defaults_and_the_command_line(tmp_path):
    secret = private_file(tmp_path / "secret", SECRET)
    path = write_config(tmp_path / "pcr.toml", f"""
model = "from-file"
log_level = "warning"

[engine]
dram_capacity = "1GiB"
max-active = 2
max_model_len = "none"
freeze_gc = false
remote_url = "redis://cache:6379/0"
remote_secret_file = "{secret}"

[engine.extra]
team = "search"

[server]
port = 9000
host = "0.0.0.0"
shutdown_timeout_s = 12
""")
    config = configs(["--config", path, "--port", "9001", "--max-num-seqs", "5"])
    assert (config.engine.dram_capacity, config.engine.max_model_len, config.engine.freeze_gc) == (2**30, None, False)
    assert config.engine.max_active == 5  # the command line wins
    assert (config.engine.remote_url, config.engine.remote_secret, config.engine.extra) == (
        "redis://cache:6379/0", SECRET, {"team": "search"})
    assert (config.server.port, config.server.host, config.server.shutdown_timeout_s) == (9001, "0.0.0.0", 12.0)
    assert config.options == cli.ServeOptions(model="from-file", log_level="warning")
    assert configs(["--config", path, "--freeze-gc"]).engine.freeze_gc is True


@pytest.mark.parametrize("text, message", [
    ("[engine]\nchunk_sise = 16\n", "unknown key 'chunk_sise'; valid keys: allow_download, announce_ttl_s, blend_backfill"),
    ("[server]\nhots = 'x'\n", "unknown key 'hots'; valid keys: api_keys, body_timeout_s"),
    ("modle = 'x'\n", "unknown key 'modle'; valid keys: log_format, log_level, model"),
    ("port = 8000\n", "port belongs in the [server] table"),
    ("[engine]\nremote_secret = 'abc'\n", "remote_secret cannot be written in a config file"),
    ("[engine]\nchunk_size = '16x'\n", "chunk_size: expected an integer, got '16x'"),
    ("[engine]\nlayerwise = 'no'\n", "layerwise: expected true or false"),
    ("[engine]\nschedule = 1\n", "schedule: expected one of fcfs, cache-aware, got 1"),
    ("[engine]\nchunk_size = true\n", "chunk_size: expected an integer, got True"),
    ("[engine]\nannounce_ttl_s = nan\n", "announce_ttl_s: expected a finite number"),
    ("[server]\napi_keys = 'k'\n", "api_keys: expected a list of strings"),
    ("engine = 3\n", "engine must be a table"),
    ("[engine\n", "is not valid TOML"),
    ("[engine]\nchunk_size = 16\nchunk-size = 32\n", "chunk_size is given twice"),
])
def test_a_bad_config_file_names_the_key(tmp_path, text, message):
    path = write_config(tmp_path / "pcr.toml", text)
    with pytest.raises(ConfigError) as exc:
        configs(["--config", path])
    assert message in str(exc.value)


def test_keys_in_a_config_file_need_a_private_file(tmp_path):
    text = "[server]\napi_keys = ['k1', 'k2']\nmetrics_key = 'scraper-key'\n"
    shared = write_config(tmp_path / "shared.toml", text, 0o644)
    with pytest.raises(ConfigError, match=r"holds api_keys, metrics_key, so it must be private: .*chmod 600"):
        configs(["--config", shared])
    private = write_config(tmp_path / "private.toml", text, 0o600)
    server = configs(["--config", private]).server
    assert (server.api_keys, server.metrics_key) == (("k1", "k2"), "scraper-key")
    assert configs(["--config", private], environ={cli.API_KEY_ENV: "env-key"}).server.api_keys == ("env-key",)


def test_a_missing_config_file_exits_2(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(pcr_rag.engine, "PCREngine", _NoModel)
    assert top_cli.main(["serve", "--config", str(tmp_path / "absent.toml")]) == 2
    assert "cannot read config file" in caplog.text


def test_without_tomllib_or_tomli_the_error_says_what_to_install(tmp_path, monkeypatch):
    path = write_config(tmp_path / "pcr.toml", "model = 'x'\n")
    monkeypatch.setitem(sys.modules, "tomllib", None)
    monkeypatch.setitem(sys.modules, "tomli", None)
    with pytest.raises(ConfigError, match="Python 3.11\\+ or the tomli package"):
        configs(["--config", path])


def test_help_groups_server_engine_and_remote_tier():
    text = parser().format_help()
    text = text[text.index("\noptions:\n"):]  # past the usage line
    server, engine, remote = (text.index(f"\n{name}:\n") for name in ("server", "engine", "remote tier"))
    assert server < text.index("--max-body-bytes") < engine < text.index("--chunk-size") < remote
    assert remote < text.index("--remote-url") and remote < text.index("--remote-secret-file")
    assert "(default: 16MiB)" in text and "(default: 2GiB)" in text


def test_the_generator_covers_new_fields_and_refuses_what_it_cannot_carry():
    """A dataclass like ServerSettings with fields added later (timeouts, limits, a key): each becomes a flag."""

    @dataclass(frozen=True)
    class Later:
        """A later settings class.

        read_timeout_s: seconds (100% of them).
        max_connections: connections at once.
        """

        read_timeout_s: float | None = 5.0
        max_connections: int = 16
        max_frame_bytes: int = 1024
        mode: Literal["fast", "safe"] = "safe"
        tags: tuple[str, ...] = ()
        token: str | None = field(default=None, repr=False)

    specs = dataclass_flags(Later, section="later")
    p = argparse.ArgumentParser()
    for spec in specs:
        add_flag(p, spec)
    assert "100%" in p.format_help()  # help is %-escaped
    args = p.parse_args(["--read-timeout-s", "none", "--max-connections", "3", "--max-frame-bytes", "2KiB",
                         "--mode", "fast", "--tags", "a", "--tags", "b"])
    assert given(args, specs) == {"read_timeout_s": None, "max_connections": 3, "max_frame_bytes": 2048,
                                  "mode": "fast", "tags": ("a", "b")}
    assert [s.flag for s in specs if s.field == "token"] == ["--token-file"]
    assert from_table({"max_connections": 4, "mode": "safe"}, specs, where="t") == {"max_connections": 4,
                                                                                     "mode": "safe"}

    @dataclass
    class Odd:
        shape: list[int] = field(default_factory=list)

    with pytest.raises(TypeError, match="no command-line flag"):
        dataclass_flags(Odd, section="odd")
    with pytest.raises(KeyError, match="no field"):
        dataclass_flags(Later, section="later", aliases={"renamed": ("--old",)})


def test_every_field_has_its_own_environment_variable():
    specs = [spec for section in cli.flag_specs().values() for spec in section]
    names = [spec.env for spec in specs]
    assert all(n.startswith("PCR_RAG_") for n in names) and len(set(names)) == len(names)
    env = {spec.dest: spec.env for spec in specs}
    assert (env["engine.max_active"], env["engine.cache_dir"], env["engine.remote_secret"]) == (
        "PCR_RAG_MAX_ACTIVE", "PCR_RAG_CACHE_DIR", "PCR_RAG_REMOTE_SECRET_FILE")
    assert (env["server.api_keys"], env["engine.model_cache_dir"], env["serve.model"]) == (
        "PCR_RAG_API_KEY", "PCR_RAG_MODEL_CACHE", "PCR_RAG_MODEL")  # the older names keep working
    assert "PCR_RAG_MAX_ACTIVE=4" in parser().format_help()


def test_every_kind_of_field_comes_from_the_environment(tmp_path):
    secret = private_file(tmp_path / "secret", SECRET)
    environ = {"PCR_RAG_MODEL": "tiny", "PCR_RAG_LOG_LEVEL": "debug", "PCR_RAG_MAX_ACTIVE": "3",
               "PCR_RAG_LAYERWISE": "false", "PCR_RAG_PREFETCH": "0", "PCR_RAG_DRAM_CAPACITY": "1GiB",
               "PCR_RAG_MAX_MODEL_LEN": "none", "PCR_RAG_ANNOUNCE_TTL_S": "7.5", "PCR_RAG_SCHEDULE": "fcfs",
               "PCR_RAG_EXTRA": '{"team": "search"}', "PCR_RAG_CHAT_TEMPLATE_KWARGS": "enable_thinking=false",
               "PCR_RAG_CACHE_DIR": str(tmp_path / "kv"), "PCR_RAG_REMOTE_URL": "redis://cache:6379/0",
               "PCR_RAG_REMOTE_SECRET_FILE": str(secret), "PCR_RAG_REMOTE_MAX_CONNECTIONS": "4",
               "PCR_RAG_PORT": "9002", "PCR_RAG_TENANT_PER_KEY": "yes", "PCR_RAG_API_KEY": "k1, k2,,",
               "PCR_RAG_METRICS_PUBLIC": "on", "PCR_RAG_NAMESPACE": ""}  # empty: unset
    config = configs([], environ=environ)
    e, s = config.engine, config.server
    assert (e.max_active, e.layerwise, e.prefetch, e.dram_capacity, e.max_model_len, e.announce_ttl_s) == (
        3, False, False, 2**30, None, 7.5)
    assert (e.schedule, e.extra, e.chat_template_kwargs, e.cache_dir, e.namespace) == (
        "fcfs", {"team": "search"}, {"enable_thinking": False}, tmp_path / "kv", "")
    assert (e.remote_url, e.remote_secret, e.remote_config.max_connections) == ("redis://cache:6379/0", SECRET, 4)
    assert (s.port, s.tenant_per_key, s.api_keys, s.metrics_public) == (9002, True, ("k1", "k2"), True)
    assert config.options == cli.ServeOptions(model="tiny", log_level="debug")


def test_flags_beat_the_environment_which_beats_the_file(tmp_path):
    path = write_config(tmp_path / "pcr.toml", "model = 'file'\n[engine]\nmax_active = 2\nchunk_size = 32\n"
                                              "prefetch_window = 3\n[server]\nport = 9000\n")
    environ = {"PCR_RAG_MAX_ACTIVE": "4", "PCR_RAG_CHUNK_SIZE": "64", "PCR_RAG_PORT": "9001", "PCR_RAG_MODEL": "env"}
    config = configs(["--config", path, "--chunk-size", "128"], environ=environ)
    assert (config.engine.prefetch_window, config.engine.max_active, config.engine.chunk_size) == (3, 4, 128)
    assert (config.server.port, config.options.model) == (9001, "env")
    assert configs(["--config", path], environ={}).engine.max_active == 2


@pytest.mark.parametrize("environ, message", [
    ({"PCR_RAG_MAX_ACTIVE": "many"}, "environment variable PCR_RAG_MAX_ACTIVE: expected an integer, got 'many'"),
    ({"PCR_RAG_LAYERWISE": "maybe"}, "environment variable PCR_RAG_LAYERWISE: expected true or false"),
    ({"PCR_RAG_SCHEDULE": "lifo"}, "PCR_RAG_SCHEDULE: expected one of fcfs, cache-aware, got 'lifo'"),
    ({"PCR_RAG_ANNOUNCE_TTL_S": "inf"}, "PCR_RAG_ANNOUNCE_TTL_S: expected a finite number"),
    ({"PCR_RAG_EXTRA": "{not json"}, "PCR_RAG_EXTRA: expected a JSON object or KEY=VALUE"),
    ({"PCR_RAG_REMOTE_SECRET_FILE": "/nonexistent/secret"}, "PCR_RAG_REMOTE_SECRET_FILE: cannot read secret file"),
])
def test_a_bad_environment_variable_is_named(environ, message):
    with pytest.raises(ConfigError) as exc:
        configs([], environ=environ)
    assert message in str(exc.value)


def test_a_bad_environment_variable_exits_2_before_the_model_loads(monkeypatch, caplog):
    monkeypatch.setattr(pcr_rag.engine, "PCREngine", _NoModel)
    monkeypatch.setenv("PCR_RAG_MAX_ACTIVE", "0")
    assert top_cli.main(["serve"]) == 2
    assert "max_active must be an int >= 1" in caplog.text
