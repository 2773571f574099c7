"""MkDocs hook: writes the Configuration reference page (``configuration.md``) at build time.

The page is generated from the dataclasses themselves, never kept by hand, so it cannot drift from the code:
`EngineConfig` (the engine), `ServerSettings` and `ServeOptions` (``pcr-rag serve``), each field with its
default, its ``pcr-rag serve`` flag and config-file key, and its text from the class docstring (the same
`FlagSpec` list ``pcr-rag serve --help`` is built from, `pcr_rag.server.cli.flag_specs`). A field without a
docstring entry is a warning, which ``mkdocs build --strict`` turns into a failed build.

The page exists only in the build (a generated `File`); nothing is written under ``docs/``.
"""

from __future__ import annotations

import dataclasses
import logging
import textwrap
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

PAGE = "configuration.md"
log = logging.getLogger("mkdocs.hooks.config_reference")  # under "mkdocs": --strict counts its warnings

INTRO = """\
# Configuration reference

Generated when the site is built, from the dataclasses' fields and docstrings (the same source as
`pcr-rag serve --help`), so it always matches the installed code.

- **Python**: `PCREngine(config=EngineConfig(...))`; the integrations take `config=` too.
- **`pcr-rag serve`**: every field is a flag (the column below; `--x / --no-x` for switches), or a key in a TOML
  file given with `--config pcr.toml` (`[engine]` and `[server]` tables; `model` and `log_level` at the top), or
  an environment variable (shown under each flag: `PCR_RAG_` and the file key in capitals, except the older
  `PCR_RAG_API_KEY` and `PCR_RAG_MODEL_CACHE`). In the environment a switch is `true`/`false` (or `1`/`0`,
  `yes`/`no`, `on`/`off`), a list is comma-separated, a table is a JSON object; an empty variable counts as unset.
  Precedence, lowest first: the dataclass default, serve's own default, the file, the environment, the command
  line (flags > env > file > defaults).
- **Secrets** never take a value on the command line (it would show in `ps`): `remote_secret` is read from
  `--remote-secret-file PATH` (key `remote_secret_file`), a file only its owner can read, else from
  `$PCR_RAG_REMOTE_SECRET`.
- **Sizes** are bytes, as an int or a string such as `"2GiB"`.

An example file (the one in `pcr_rag.server.cli`'s docstring, which `pcr-rag serve --help` shows):
"""



def config_example() -> str:
    """The TOML example of `pcr_rag.server.cli`'s docstring (its one ``::`` block), so the page and ``--help``
    show one example."""
    from pcr_rag.server import cli

    block = (cli.__doc__ or "").split("::\n\n", 1)[1]
    lines: list[str] = []
    for line in block.splitlines():
        if line and not line.startswith("    "):
            break
        lines.append(line)
    return textwrap.dedent("\n".join(lines)).strip()


SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("engine", "EngineConfig", "`pcr_rag.EngineConfig`: the engine (model placement, cache tiers, batching, "
                               "scheduling, the remote tier, encryption)."),
    ("server", "ServerSettings", "`pcr_rag.server.ServerSettings`: how `pcr-rag serve` listens, authenticates, "
                                 "limits requests and shuts down."),
    ("serve", "ServeOptions", "What `pcr-rag serve` needs besides the two above (top-level keys of the "
                              "config file)."),
)


def _cell(text: str) -> str:
    """Markdown table cell: pipes escaped, lines joined."""
    return " ".join(text.split()).replace("|", "\\|")


def _default(value: Any) -> str:
    if value is None:
        return "`None`"
    if isinstance(value, (tuple, dict)) and not value:
        return "(none)"
    return f"`{value!r}`"


def render() -> str:
    """The page's Markdown, from the installed pcr_rag."""
    from pcr_rag.server.cli import SECTIONS as CLASSES
    from pcr_rag.server.cli import SERVE_ENGINE_DEFAULTS, flag_specs

    specs = flag_specs()
    out = [INTRO, f"\n```toml\n{config_example()}\n```\n"]
    for section, name, blurb in SECTIONS:
        cls = CLASSES[section]
        defaults = {f.name: (f.default if f.default is not dataclasses.MISSING else
                             f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
                    for f in dataclasses.fields(cls)}
        out += [f"## {name}", "", blurb, "", "| field and `pcr-rag serve` flag | default | meaning |", "|---|---|---|"]
        for spec in specs[section]:
            if spec.help == spec.field.replace("_", " "):
                log.warning("%s.%s has no entry in the class docstring: document it there (the Configuration "
                            "reference and `pcr-rag serve --help` are generated from it)", name, spec.field)
            default = _default(defaults[spec.field])
            if section == "engine" and spec.field in SERVE_ENGINE_DEFAULTS:
                default += f" (serve: `{SERVE_ENGINE_DEFAULTS[spec.field]!r}`)"
            if spec.kind == "bool":
                flags = f"`--{spec.key.replace('_', '-')}` / `--no-{spec.key.replace('_', '-')}`"
            else:
                flags = f"`{spec.flag} {spec.metavar}`"
            if spec.aliases:
                flags += " (also " + ", ".join(f"`{a}`" for a in spec.aliases) + ")"
            if spec.env:
                flags += f"<br>env `{spec.env}`"
            out.append(f"| **`{spec.field}`**<br>{_cell(flags)} | {_cell(default)} | {_cell(spec.help)} |")
        out.append("")
    return "\n".join(out)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated page to the build (replacing a stale file of the same name, if any)."""
    old = files.get_file_from_path(PAGE)
    if old is not None:
        files.remove(old)
    files.append(File.generated(config, PAGE, content=render()))
    return files
