"""Secrets stay secret (issue 47, item 5): a remote URL's password never appears in a message, a ``repr`` or a log
line; it can come from a private file (``--remote-url-file``) instead of the command line, where ``ps`` shows it;
and a config file holding it must be private, as one holding API keys."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from pcr_rag.cache.config import RemoteConfig, parse_cluster_url, redacted_url
from pcr_rag.config import EngineConfig
from pcr_rag.errors import ConfigError
from pcr_rag.server import cli

PASSWORD = "hunter2-very-secret"
URL = f"redis://:{PASSWORD}@cache.internal:6379/0"
SECRET = "0123456789abcdef-shared-by-replicas"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for name in ("PCR_RAG_REMOTE_SECRET", cli.API_KEY_ENV, cli.REMOTE_URL_FILE_ENV, "PCR_RAG_REMOTE_URL"):
        monkeypatch.delenv(name, raising=False)


def configs(argv: list[str], environ: dict[str, str] | None = None) -> cli.ServeConfig:
    parser = argparse.ArgumentParser(prog="pcr-rag serve")
    cli.add_arguments(parser)
    return cli.serve_config(parser.parse_args(argv), environ={} if environ is None else environ)


def private_file(path: Path, text: str, mode: int = 0o600) -> str:
    path.write_text(text)
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize(("url", "shown"), [
    (URL, "redis://:***@cache.internal:6379/0"),
    (f"rediss://user:{PASSWORD}@h:1/0", "rediss://user:***@h:1/0"),
    (f"redis+cluster://:{PASSWORD}@h1:7000,h2:7001", "redis+cluster://:***@h1:7000,h2:7001"),
    (f"redis://{PASSWORD}@h:1", "redis://***@h:1"),  # a bare user info is the password to Redis
    (f"redis://:p@ss:{PASSWORD}@h:1/0", "redis://:***@h:1/0"),  # an unescaped @ in the password
    ("redis://h:6379/0", "redis://h:6379/0"),
])
def test_redacted_url_hides_every_password(url, shown) -> None:
    assert redacted_url(url) == shown


def test_no_repr_or_config_error_shows_the_password() -> None:
    config = EngineConfig(remote_url=URL, remote_secret=SECRET)
    assert PASSWORD not in repr(config) and "***" in repr(config)
    assert PASSWORD not in repr(config.remote_config) and PASSWORD not in str(config.remote_config)
    for bad in (f"redis+cluster://:{PASSWORD}@h:1/3", f"http://:{PASSWORD}@h:1/0",
                f"redis+cluster://:{PASSWORD}@h:notaport"):
        with pytest.raises(ConfigError) as caught:
            EngineConfig(remote_url=bad, remote_secret=SECRET)
        assert PASSWORD not in str(caught.value) and "***" in str(caught.value)
    with pytest.raises(ValueError) as caught:
        parse_cluster_url(f"redis+cluster://:{PASSWORD}@h:1?x=1")
    assert PASSWORD not in str(caught.value)
    assert PASSWORD not in repr(RemoteConfig(URL, secret=SECRET))


def test_the_remote_tier_logs_no_password(caplog) -> None:
    from pcr_rag.cache.tiers.remote_url import open_store

    pytest.importorskip("redis")
    with caplog.at_level(logging.DEBUG):
        store = open_store(RemoteConfig(f"redis://:{PASSWORD}@127.0.0.1:1/0", secret=SECRET, timeout_s=0.05,
                                        connect_timeout_s=0.05))
        try:
            with pytest.raises(Exception) as caught:  # nothing listens on port 1
                store.get_many(["x"])
            assert PASSWORD not in str(caught.value) and PASSWORD not in store.describe()
        finally:
            store.close()
    assert PASSWORD not in caplog.text


# ------------------------------------------------------------------------------------------------ serve's flags
def test_the_url_comes_from_a_private_file(tmp_path) -> None:
    path = private_file(tmp_path / "url", URL + "\n")
    secret = private_file(tmp_path / "secret", SECRET)
    config = configs(["--remote-url-file", path, "--remote-secret-file", secret]).engine
    assert config.remote_url == URL and config.remote_config is not None
    assert configs([], environ={cli.REMOTE_URL_FILE_ENV: path, "PCR_RAG_REMOTE_SECRET_FILE": secret}
                   ).engine.remote_url == URL
    toml = private_file(tmp_path / "pcr.toml", f'[engine]\nremote_url_file = "{path}"\nremote_secret_file = '
                                               f'"{secret}"\n', 0o644)  # the file names paths only: may be shared
    assert configs(["--config", toml]).engine.remote_url == URL


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_url_file_others_can_read_is_refused(tmp_path, mode) -> None:
    path = private_file(tmp_path / "url", URL, mode)
    with pytest.raises(ConfigError, match="chmod 600") as caught:
        configs(["--remote-url-file", path, "--remote-insecure"])
    assert PASSWORD not in str(caught.value)


def test_a_url_given_twice_in_one_place_is_refused(tmp_path) -> None:
    path = private_file(tmp_path / "url", URL)
    with pytest.raises(ConfigError, match="both remote_url and remote_url_file"):
        configs(["--remote-url-file", path, "--remote-url", "redis://other:6379/0", "--remote-insecure"])
    with pytest.raises(ConfigError, match="empty"):
        configs(["--remote-url-file", private_file(tmp_path / "empty", "\n"), "--remote-insecure"])


def test_a_config_file_holding_a_password_must_be_private(tmp_path) -> None:
    text = f'[engine]\nremote_url = "{URL}"\nremote_insecure = true\n'
    shared = private_file(tmp_path / "shared.toml", text, 0o644)
    with pytest.raises(ConfigError, match=r"remote_url \(with a password\), so it must be private") as caught:
        configs(["--config", shared])
    assert PASSWORD not in str(caught.value)
    assert configs(["--config", private_file(tmp_path / "private.toml", text)]).engine.remote_url == URL
    no_password = private_file(tmp_path / "open.toml", '[engine]\nremote_url = "redis://h:6379/0"\n'
                                                       'remote_insecure = true\n', 0o644)
    assert configs(["--config", no_password]).engine.remote_url == "redis://h:6379/0"
