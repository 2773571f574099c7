"""`pcr-rag serve`: the OpenAI-compatible server (see `pcr_rag.server`).

    pcr-rag serve --model smollm2-135m-instruct --cache-dir /var/cache/pcr --api-key "$KEY"
    pcr-rag serve --config pcr.toml --port 8001      # the file's settings, its port overridden

Every `EngineConfig` and `ServerSettings` field is a flag generated from the dataclass (`pcr_rag.server.flags`),
named after the field (``max_active`` -> ``--max-active``, ``layerwise`` -> ``--layerwise/--no-layerwise``) and
helped by its docstring, so a new field is a flag without anyone writing one. `ALIASES` keeps the older flags
(``--dram``, ``--ssd``, ``--api-key``, ``--shutdown-timeout``, ``--no-cache``) and adds vLLM's names where vLLM has
the same setting (``--max-num-seqs``, ``--quantization``, ``--enable-prefix-caching``, ``--download-dir``,
``--uvicorn-log-level``; ``--max-model-len``, ``--served-model-name``, ``--host``, ``--port`` are the fields' own).
The remote secret (``remote_secret``, declared ``repr=False``) has no value flag, since a value on the command line
shows in ``ps``: ``--remote-secret-file PATH`` reads it from a file only its owner can read, else the engine reads
``$PCR_RAG_REMOTE_SECRET``. A remote URL that holds a password is best read from such a file too:
``--remote-url-file PATH`` (``$PCR_RAG_REMOTE_URL_FILE``, key ``remote_url_file``) instead of ``--remote-url``; a
config file that holds such a URL itself must be private. API keys: ``--api-key`` (repeatable), else ``$PCR_RAG_API_KEY`` (comma-separated), else
the config file.

Every field can also come from an environment variable, ``PCR_RAG_`` and its config-file key in capitals
(``PCR_RAG_MAX_ACTIVE=4``, ``PCR_RAG_LAYERWISE=false``, ``PCR_RAG_REMOTE_SECRET_FILE=/run/secrets/pcr``), except
where `ENV_NAMES` keeps an older name (``PCR_RAG_API_KEY``, ``PCR_RAG_MODEL_CACHE``); see `pcr_rag.server.flags`
for how values are written.

Precedence, lowest first: the dataclass defaults, serve's own (`SERVE_ENGINE_DEFAULTS`: the server owns its
process, so ``freeze_gc`` is on), the ``--config`` file, the environment, the command line.

The config file is TOML: top-level keys are `ServeOptions` fields, the ``[engine]`` table holds `EngineConfig`
fields and ``[server]`` holds `ServerSettings` fields, named as the fields (``-`` may stand for ``_``), values typed
as TOML or written as on the command line (``"2GiB"``, ``"none"``; paths relative to the working directory). A
secret is a path (``remote_secret_file``); keys (``api_keys``, ``metrics_key``: fields named ``*_key(s)``) are
accepted only from a file only its owner can read. Unknown keys are an error naming the valid ones::

    model = "smollm2-135m-instruct"

    [engine]
    cache_dir = "/var/cache/pcr"
    dram_capacity = "8GiB"
    remote_url = "redis://cache.internal:6379/0"
    remote_secret_file = "/etc/pcr-rag/remote-secret"

    [server]
    host = "0.0.0.0"
    shutdown_timeout_s = 60

A bad value (a flag argparse cannot convert, a field its dataclass refuses, an unreadable or shared secret file)
stops the command with status 2 and a message before the model loads. Flags are never abbreviated: with flags
generated from fields, an abbreviation that works today would change meaning when a field is added.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal, get_args

from pcr_rag import logs
from pcr_rag.cache.config import redacted_url
from pcr_rag.config import EngineConfig
from pcr_rag.errors import ConfigError
from pcr_rag.logs import LOG_FORMATS, LogFormat
from pcr_rag.model.weights import WEIGHT_FORMATS
from pcr_rag.sched.admission import SCHEDULES
from pcr_rag.server.flags import (
    MAX_SECRET_BYTES,
    FlagSpec,
    add_flag,
    dataclass_flags,
    from_env,
    from_table,
    given,
    load_toml,
    read_private_file,
)
from pcr_rag.server.settings import ServerSettings

__all__ = ["ALIASES", "API_KEY_ENV", "ENV_NAMES", "ENV_PREFIX", "SERVE_ENGINE_DEFAULTS", "ServeConfig", "ServeOptions", "add_arguments",
           "build_configs", "flag_specs", "run", "serve_config"]

log = logging.getLogger(__name__)

API_KEY_ENV = "PCR_RAG_API_KEY"
REMOTE_URL_FILE_ENV = "PCR_RAG_REMOTE_URL_FILE"  # names a private file holding remote_url (`--remote-url-file`)
ENV_PREFIX = "PCR_RAG_"  # a field's environment variable: this and its config-file key in capitals
LogLevel = Literal["critical", "error", "warning", "info", "debug"]
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)


@dataclass(frozen=True)
class ServeOptions:
    """What `pcr-rag serve` needs besides the engine's and the server's settings.

    model: model alias or local HF directory (None: the default model, smollm2-135m-instruct).
    log_level: the server's (uvicorn's) log level.
    log_format: the log lines' format: "text", or "json" (one JSON object per line, `pcr_rag.logs`); either way
        each line of a request carries its request id.
    """

    model: str | None = None
    log_level: LogLevel = "info"
    log_format: LogFormat = "text"

    def __post_init__(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {list(LOG_LEVELS)}, got {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be one of {list(LOG_FORMATS)}, got {self.log_format!r}")


@dataclass(frozen=True)
class ServeConfig:
    """Everything one ``pcr-rag serve`` command line (and its config file) asks for, validated."""

    engine: EngineConfig
    server: ServerSettings
    options: ServeOptions


SERVE_ENGINE_DEFAULTS: dict[str, Any] = {"freeze_gc": True}  # the server owns its process (see gc_pauses)

# section -> field -> extra option strings: older flags of `pcr-rag serve`, and vLLM's names for the same setting
ALIASES: dict[str, dict[str, tuple[str, ...]]] = {
    "serve": {"log_level": ("--uvicorn-log-level",)},
    "engine": {"dram_capacity": ("--dram",), "ssd_capacity": ("--ssd",), "max_active": ("--max-num-seqs",),
               "weights": ("--quantization",), "enable_cache": ("--enable-prefix-caching",),
               "model_cache_dir": ("--download-dir",)},
    "server": {"api_keys": ("--api-key",), "shutdown_timeout_s": ("--shutdown-timeout",)},
}
# section -> field -> its environment variable where that is not the generated name (names users already set)
ENV_NAMES: dict[str, dict[str, str]] = {
    "server": {"api_keys": API_KEY_ENV},
    "engine": {"model_cache_dir": "PCR_RAG_MODEL_CACHE"},  # the model loader's own default (runtime.model_cache)
}
_CHOICES: dict[str, dict[str, tuple[str, ...]]] = {"engine": {"schedule": SCHEDULES, "weights": WEIGHT_FORMATS}}
_NOTES: dict[str, dict[str, str]] = {
    "engine": {"extra": "Free-form KEY=VALUE settings kept with the config (repeatable; string values)."},
    "server": {"api_keys": f"Repeatable (${API_KEY_ENV}: comma-separated)."},
}
SECTIONS: dict[str, type] = {"serve": ServeOptions, "engine": EngineConfig, "server": ServerSettings}
_GROUPS = {
    "server": "how the server listens, authenticates, limits requests and shuts down (ServerSettings)",
    "engine": "the engine: model, cache tiers, batching, scheduling (EngineConfig)",
    "remote tier": "a Valkey/Redis tier below SSD shared by replicas, and the secret that authenticates its values "
                   "(EngineConfig.remote_*)",
}


@lru_cache(maxsize=1)
def flag_specs() -> dict[str, tuple[FlagSpec, ...]]:
    """Section -> one `FlagSpec` per field of its dataclass (generated, never listed by hand), the remote tier's
    last. RuntimeError if two fields would share an environment variable."""
    out = {section: dataclass_flags(cls, section=section, aliases=ALIASES.get(section),
                                    choices=_CHOICES.get(section),
                                    defaults=SERVE_ENGINE_DEFAULTS if section == "engine" else None,
                                    notes=_NOTES.get(section), env_prefix=ENV_PREFIX, env_names=ENV_NAMES.get(section))
           for section, cls in SECTIONS.items()}
    out["engine"] = tuple(sorted(out["engine"], key=lambda spec: _group_of(spec) == "remote tier"))
    seen: dict[str, str] = {}
    for spec in (spec for specs in out.values() for spec in specs):
        if spec.env in seen:
            raise RuntimeError(f"{spec.dest} and {seen[spec.env]} would share {spec.env}; name one in ENV_NAMES")
        seen[spec.env] = spec.dest
    return out


def _group_of(spec: FlagSpec) -> str:
    if spec.section == "engine" and spec.field.startswith("remote_"):
        return "remote tier"
    return {"serve": "server" if spec.field.startswith("log_") else "engine"}.get(spec.section, spec.section)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # exact flag names only: with flags generated from fields, an abbreviation that works today becomes ambiguous
    # (or means another flag) when a field with the same prefix is added
    parser.allow_abbrev = False
    parser.epilog = ((parser.epilog + "\n\n") if parser.epilog else "") + (
        f"Every setting may also come from an environment variable: {ENV_PREFIX} and its config-file key in capitals "
        f"(e.g. {ENV_PREFIX}MAX_ACTIVE=4, {ENV_PREFIX}LAYERWISE=false; API keys: {API_KEY_ENV}=k1,k2). "
        "Precedence: flags > environment > --config file > defaults.")
    parser.add_argument("--config", metavar="FILE.toml", default=None,
                        help="read settings from a TOML file ([engine] and [server] tables, model and log_level at "
                             "the top); flags on the command line override it")
    groups = {name: parser.add_argument_group(name, description) for name, description in _GROUPS.items()}
    groups["remote tier"].add_argument(
        "--remote-url-file", metavar="PATH", default=argparse.SUPPRESS,
        help=f"read remote_url from a file only its owner can read (chmod 600), so a password in the URL never "
             f"shows in ps; instead of --remote-url ({REMOTE_URL_FILE_ENV}; key remote_url_file in [engine])")
    for specs in flag_specs().values():
        for spec in specs:
            action = add_flag(groups[_group_of(spec)], spec)
            if spec.section == "engine" and spec.field == "enable_cache":
                groups["engine"].add_argument("--no-cache", dest=action.dest, action="store_false",
                                              default=argparse.SUPPRESS, help="same as --no-enable-cache")


def _config_file(path: str) -> dict[str, dict[str, Any]]:
    """Section -> field -> value from a TOML config file (ConfigError for an unknown or bad key)."""
    table, exposure = load_toml(path)
    specs = flag_specs()
    tables = {section: table.pop(section) for section in ("engine", "server") if section in table}
    for section, value in tables.items():
        if not isinstance(value, dict):
            raise ConfigError(f"config file {path}: {section} must be a table ([{section}]), got {value!r}")
    for key in table:
        home = [s for s in ("engine", "server") if key.replace("-", "_") in {spec.key for spec in specs[s]}]
        if home:
            raise ConfigError(f"config file {path}: {key} belongs in the [{home[0]}] table")
    engine = dict(tables.get("engine", {}))
    url_file = engine.pop("remote_url_file", engine.pop("remote-url-file", None))
    out = {"serve": from_table(table, specs["serve"], where=f"config file {path}"),
           **{section: from_table(engine if section == "engine" else tables.get(section, {}), specs[section],
                                  where=f"config file {path} [{section}]")
              for section in ("engine", "server")}}
    keys = sorted(field for found in out.values() for field in found if field.endswith(("_key", "_keys")))
    if url_has_password(out["engine"].get("remote_url")):
        keys.append("remote_url (with a password)")
    if keys and exposure:
        raise ConfigError(f"config file {path} holds {', '.join(keys)}, so it must be private: {exposure}")
    if url_file is not None:
        _set_url_from_file(out["engine"], url_file, f"config file {path}")
    return out


def url_has_password(url: object) -> bool:
    """Whether ``url`` (a remote URL, or None) carries a password, i.e. what `redacted_url` would hide."""
    return url is not None and redacted_url(url) != str(url)


def _set_url_from_file(engine: dict[str, Any], path: object, where: str) -> None:
    """``engine["remote_url"]`` from the private file ``path`` (one line; `read_private_file`), refusing a URL
    given twice in the same place."""
    if "remote_url" in engine:
        raise ConfigError(f"{where} gives both remote_url and remote_url_file; keep one (the file keeps a password "
                          f"out of ps and of shared files)")
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"{where}: remote_url_file must be a path, got {path!r}")
    try:
        url = read_private_file(path, max_bytes=MAX_SECRET_BYTES, what="remote URL file").decode("utf-8").strip()
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise ConfigError(f"{where}: {exc}") from None
    if not url:
        raise ConfigError(f"{where}: the remote URL file {path} is empty")
    engine["remote_url"] = url


def serve_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServeConfig:
    """The validated configuration of a parsed command line and the environment (``environ``, default
    ``os.environ``); loads no model. Layers, lowest first: defaults, the config file, the environment, the flags.
    ConfigError / ValueError say what is wrong (`EngineConfig` raises ConfigError, `ServerSettings` ValueError)."""
    environ = os.environ if environ is None else environ
    values: dict[str, dict[str, Any]] = {"serve": {}, "engine": dict(SERVE_ENGINE_DEFAULTS), "server": {}}
    if getattr(args, "config", None):
        for section, found in _config_file(args.config).items():
            values[section].update(found)
    for section, specs in flag_specs().items():
        env = from_env(environ, specs)
        flags = given(args, specs)
        if section == "engine":  # a URL file counts in its own layer, as the URL would
            if environ.get(REMOTE_URL_FILE_ENV):
                _set_url_from_file(env, environ[REMOTE_URL_FILE_ENV], f"${REMOTE_URL_FILE_ENV}")
            if getattr(args, "remote_url_file", None) is not None:
                _set_url_from_file(flags, args.remote_url_file, "--remote-url-file")
        values[section].update(env)
        values[section].update(flags)
    server = values["server"]
    server["api_keys"] = tuple(k.strip() for k in server.get("api_keys", ()) if k.strip())
    return ServeConfig(engine=EngineConfig(**values["engine"]), server=ServerSettings(**server),
                       options=ServeOptions(**values["serve"]))


def build_configs(args: argparse.Namespace, environ: Mapping[str, str] | None = None,
                  ) -> tuple[EngineConfig, ServerSettings]:
    """The engine's and the server's configuration of a parsed command line (see `serve_config`)."""
    config = serve_config(args, environ)
    return config.engine, config.server


def run(args: argparse.Namespace) -> int:
    try:
        config = serve_config(args)
    except (ValueError, OSError) as exc:  # before the model loads: say what is wrong and stop
        log.error("pcr-rag serve: %s (see pcr-rag serve --help)", exc)
        return 2
    if config.options.log_format != "text":  # text: the command's handler (pcr_rag.cli) or the application's stays
        logs.install(config.options.log_format)
    from pcr_rag.engine import PCREngine
    from pcr_rag.server.lifecycle import serve

    engine = PCREngine(model=config.options.model, config=config.engine)
    settings = config.server
    log.info("serving %s (auth %s%s%s)", settings.served_model_name or engine.loaded.name,
             "on" if settings.api_keys else "off", ", tenant per key" if settings.tenant_per_key else "",
             ", remote tier on" if config.engine.remote_url else "")
    serve(engine, settings, log_level=config.options.log_level)
    return 0
