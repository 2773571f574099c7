"""Command-line flags generated from config dataclasses: one flag per field, so a new field is a flag at once.

`dataclass_flags` reads a dataclass's fields, their annotations and its docstring's ``name: text`` entries (the
``Attributes:`` section where there is one; ``a / b: text`` documents both) and returns one `FlagSpec` per field.
`add_flag` puts a spec on an argparse group; every flag defaults to ``argparse.SUPPRESS``, so `given` returns only
the flags that were on the command line, which lets a config file sit between the dataclass defaults and the command
line. `from_table` reads a config file's table with the same conversions and messages, and refuses unknown keys.
`from_env` reads each field's environment variable (`FlagSpec.env`, ``PCR_RAG_<KEY>`` for `pcr-rag serve`) with
the same conversions; a caller layers them: defaults < file < environment < command line.

Environment values are written as on the command line, except: a switch takes ``true``/``false`` (also
``1``/``0``, ``yes``/``no``, ``on``/``off``); a repeatable string flag takes a comma-separated list; a dict takes a
JSON object (or one ``KEY=VALUE``); a secret's variable (``..._FILE``) names the file that holds it. An empty
variable counts as unset.

Annotations and their flags (an ``Optional`` one also takes ``none``):

- ``bool`` -> ``--flag`` / ``--no-flag``
- ``int``; ``float`` (finite: NaN and inf are refused); ``str``, ``Path`` and ``Any`` -> a string
- ``int | str`` and an ``int`` field named ``*_bytes`` -> a byte size, an int or a string like ``2GiB`` (an int)
- ``Literal[...]`` -> one of its values
- ``tuple[str, ...]`` -> a repeatable flag; ``dict[str, ...]`` -> a repeatable flag taking a JSON object
  (``'{"enable_thinking": false}'``, as vLLM's ``--default-chat-template-kwargs``) or ``KEY=VALUE`` whose value is
  read as JSON (``enable_thinking=false`` is the boolean false, ``n=2`` a number, ``x='"2"'`` the string "2"); a
  value that is not JSON is a string (``name=Ada``), except Python's ``True`` / ``False`` / ``None``, which are
  refused naming their JSON spelling: as a string, "False" would be true in a template's ``if``
- a field declared with ``repr=False`` holds a secret: it gets ``--<name>-file PATH`` (key ``<name>_file`` in a
  file) instead of a value flag, because a value on the command line shows in ``ps``; `read_secret_file` reads it.

Any other annotation raises `TypeError` when the flags are built, so a field never silently lacks its flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import re
import stat
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pcr_rag.errors import ConfigError
from pcr_rag.units import parse_bytes

__all__ = ["FlagSpec", "add_flag", "dataclass_flags", "field_docs", "from_env", "from_table", "given", "load_toml",
           "read_private_file", "read_secret_file"]

Kind = Literal["bool", "int", "float", "str", "path", "bytes", "choice", "list", "dict", "secret"]

MAX_SECRET_BYTES = 64 * 1024  # a secret is a line of text; a bigger file is the wrong file
MAX_CONFIG_BYTES = 1024 * 1024  # a config file is a few dozen keys
_METAVARS: dict[str, str] = {"int": "N", "float": "X", "str": "STR", "path": "PATH", "bytes": "BYTES",
                             "dict": "KEY=VALUE", "secret": "PATH"}
_ENTRY = re.compile(r"(?P<names>[a-z_][a-z0-9_]*(?:\s*/\s*[a-z_][a-z0-9_]*)*):(?:\s+(?P<text>.*))?")


@dataclass(frozen=True)
class FlagSpec:
    """How one dataclass field appears on the command line and in a config file.

    ``section`` names the dataclass (it prefixes the argparse ``dest``, so two dataclasses may share a field name);
    ``default`` is the value the flag stands for when absent (shown in ``--help``); ``aliases`` are extra option
    strings (older names, vLLM's names); ``choices`` restrict a string (from ``Literal`` or given by the caller);
    ``env`` is the environment variable that may also set it ("" = none).
    """

    section: str
    field: str
    kind: Kind
    optional: bool
    default: Any
    help: str
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    env: str = ""

    @property
    def dest(self) -> str:
        return f"{self.section}.{self.field}"

    @property
    def key(self) -> str:
        """The key in a config file: the field name, or ``<field>_file`` for a secret."""
        return f"{self.field}_file" if self.kind == "secret" else self.field

    @property
    def flag(self) -> str:
        """The generated option string: ``--`` and the key with dashes."""
        return "--" + self.key.replace("_", "-")

    @property
    def option_strings(self) -> tuple[str, ...]:
        return (self.flag, *self.aliases)

    def from_text(self, text: str) -> Any:
        """A command-line string as the field's value (one item for a repeatable flag); ValueError says why not."""
        if self.optional and text.strip().lower() == "none":
            return None
        if self.kind == "int":
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"expected an integer, got {text!r}") from None
        if self.kind == "float":
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"expected a number, got {text!r}") from None
            return _finite(value)
        if self.kind == "bytes":
            return parse_bytes(text)
        if self.kind == "choice":
            if text not in self.choices:
                raise ValueError(f"expected one of {', '.join(self.choices)}, got {text!r}")
            return text
        if self.kind == "dict":
            return _dict_items(text)
        if self.kind == "secret":
            return read_secret_file(text)
        if self.kind == "bool":
            raise ValueError(f"expected true or false (not a string), got {text!r}")
        return text  # str, path, list item

    def from_value(self, value: Any) -> Any:
        """A config file's value (TOML types) as the field's value; strings go through `from_text`."""
        if self.kind == "list":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"expected a list of strings, got {value!r}")
            return tuple(value)
        if self.kind == "dict":
            if not isinstance(value, dict):
                raise ValueError(f"expected a table, got {value!r}")
            return dict(value)
        if isinstance(value, str):
            return self.from_text(value)
        if self.kind == "bool" and isinstance(value, bool):
            return value
        if self.kind in ("int", "bytes") and isinstance(value, int) and not isinstance(value, bool):
            return parse_bytes(value) if self.kind == "bytes" else value
        if self.kind == "float" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return _finite(float(value))
        expected = {"bool": "true or false", "int": "an integer", "float": "a number",
                    "bytes": "an integer of bytes or a string like '2GiB'",
                    "choice": f"one of {', '.join(self.choices)}"}.get(self.kind, "a string")
        raise ValueError(f"expected {expected}, got {value!r}")

    def from_env_text(self, text: str) -> Any:
        """An environment variable's value as the field's value (see the module docstring); ValueError says why
        not."""
        if self.kind == "bool":
            word = text.strip().lower()
            if word in _TRUE_WORDS or word in _FALSE_WORDS:
                return word in _TRUE_WORDS
            raise ValueError(f"expected true or false, got {text!r}")
        if self.kind == "list":
            return tuple(item.strip() for item in text.split(",") if item.strip())
        if self.kind == "dict":
            return dict(_dict_items(text))
        return self.from_text(text)

    @property
    def metavar(self) -> str:
        if self.kind == "choice":
            return "{" + ",".join(self.choices) + "}"
        if self.kind == "list":  # api_keys -> KEY
            return self.field.rsplit("_", 1)[-1].rstrip("s").upper() or "VALUE"
        return _METAVARS[self.kind]

    def help_text(self) -> str:
        """The ``--help`` line: the field's documentation and its default (``%`` escaped for argparse)."""
        text = self.help
        if self.kind == "secret":
            text = ("read from a file only its owner can read (as ssh wants of keys; a trailing newline is "
                    f"dropped): {text}")
        shown = _shown(self.default, self.kind)
        if shown is not None:
            text = f"{text} (default: {shown})"
        return text.replace("%", "%%")


_PYTHON_WORDS = {"True": "true", "False": "false", "None": "null"}
_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")


def _dict_items(text: str) -> tuple[tuple[str, Any], ...]:
    """One occurrence of a dict flag as (key, value) pairs: a JSON object, or ``KEY=VALUE`` (see the module
    docstring); ValueError says why not."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"expected a JSON object or KEY=VALUE, got {text!r} ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object or KEY=VALUE, got {text!r}")
        return tuple(value.items())
    name, sep, raw = text.partition("=")
    if not sep or not name.strip():
        raise ValueError(f"expected KEY=VALUE (the value read as JSON) or a JSON object, got {text!r}")
    if raw.strip() in _PYTHON_WORDS:
        raise ValueError(f"{name.strip()}={raw.strip()}: write JSON's {_PYTHON_WORDS[raw.strip()]} (the string "
                         f"{raw.strip()!r} would count as true in a template); quote it for the string: "
                         f"{name.strip()}='\"{raw.strip()}\"'")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        value = raw  # not JSON: the text itself
    return ((name.strip(), value),)


def _finite(value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")
    return value


def _shown(default: Any, kind: str) -> str | None:
    """A default as one would type it (None: nothing worth showing)."""
    if kind == "secret" or default is None or default in ((), {}):
        return None
    if kind == "bool":
        return "on" if default else "off"
    if kind == "bytes" and isinstance(default, int) and default > 0:
        for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if default % size == 0:
                return f"{default // size}{unit}"
    if default == "":
        return "''"
    return str(default)


def field_docs(cls: type) -> dict[str, str]:
    """Each documented field's text from the docstring's ``name: text`` entries (``a / b: text`` documents both).

    Entries come from the ``Attributes:`` section if there is one, else from the whole docstring; a line indented
    deeper than its entry continues it; a line that names something other than fields is not an entry.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "Attributes:":
            lines = lines[i + 1:]
            break
    parts: dict[str, list[str]] = {}
    current: list[str] = []
    indent = -1
    for line in lines:
        stripped = line.strip()
        depth = len(line) - len(line.lstrip())
        match = _ENTRY.fullmatch(stripped)
        entry = [n.strip() for n in match.group("names").split("/")] if match else []
        if entry and all(n in names for n in entry) and (indent < 0 or depth <= indent):
            indent = depth
            current = entry
            for name in entry:
                parts[name] = [match.group("text") or ""]
        elif current and stripped and depth > indent:
            for name in current:
                parts[name].append(stripped)
        else:
            current = []
    return {name: " ".join(p for p in texts if p) for name, texts in parts.items()}


def _kind(name: str, hint: Any) -> tuple[Kind, bool, tuple[str, ...]]:
    """(kind, optional, Literal choices) of an annotation; TypeError for one no flag can carry."""
    origin = typing.get_origin(hint)
    members: tuple[Any, ...] = (hint,)
    if origin in (typing.Union, types.UnionType):
        members = typing.get_args(hint)
    optional = type(None) in members
    rest = frozenset(m for m in members if m is not type(None))
    if len(rest) == 1:
        (only,) = rest
        only_origin = typing.get_origin(only)
        if only is bool:
            kind: Kind = "bool"
        elif only is int:
            kind = "bytes" if name.endswith("_bytes") else "int"
        elif only is float:
            kind = "float"
        elif only in (str, Any):
            kind = "str"
        elif only is Path:
            kind = "path"
        elif only_origin is Literal and all(isinstance(a, str) for a in typing.get_args(only)):
            return "choice", optional, tuple(typing.get_args(only))
        elif only_origin is tuple and typing.get_args(only)[1:] == (Ellipsis,) and typing.get_args(only)[0] is str:
            kind = "list"
        elif only_origin is dict and typing.get_args(only)[:1] == (str,):
            kind = "dict"
        else:
            raise TypeError(f"field {name!r}: no command-line flag for the annotation {hint!r}")
    elif rest == {int, float}:
        kind = "float"
    elif rest == {int, str}:
        kind = "bytes"
    elif rest == {str, Path}:
        kind = "path"
    else:
        raise TypeError(f"field {name!r}: no command-line flag for the annotation {hint!r}")
    if optional and kind == "bool":
        raise TypeError(f"field {name!r}: an optional bool has three values; no --flag/--no-flag carries them")
    return kind, optional, ()


def dataclass_flags(cls: type, *, section: str, aliases: Mapping[str, tuple[str, ...]] | None = None,
                    choices: Mapping[str, Iterable[str]] | None = None, defaults: Mapping[str, Any] | None = None,
                    notes: Mapping[str, str] | None = None, env_prefix: str = "",
                    env_names: Mapping[str, str] | None = None) -> tuple[FlagSpec, ...]:
    """One `FlagSpec` per field of the dataclass ``cls`` that its constructor takes (``init``), in field order.

    ``aliases`` / ``choices`` / ``defaults`` / ``notes`` / ``env_names`` are keyed by field name: extra option
    strings, allowed strings, the default a caller applies instead of the dataclass's (shown in ``--help``), text
    added to the docstring's, and an environment variable's name other than the generated one. A key that is not a
    field raises KeyError (a renamed field must not leave an alias behind). With ``env_prefix``, each field's
    environment variable is ``env_prefix`` + its key in capitals (``PCR_RAG_`` + ``max_active`` ->
    ``PCR_RAG_MAX_ACTIVE``; a secret's ``PCR_RAG_REMOTE_SECRET_FILE``); without, fields have none.
    """
    aliases, choices, defaults, notes = aliases or {}, choices or {}, defaults or {}, notes or {}
    env_names = env_names or {}
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for extra in (aliases, choices, defaults, notes, env_names):
        unknown = sorted(set(extra) - set(fields))
        if unknown:
            raise KeyError(f"{cls.__name__} has no field(s) {unknown}")
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    specs = []
    for name, f in fields.items():
        kind, optional, literal = _kind(name, hints[name])
        if not f.repr:
            if kind != "str":
                raise TypeError(f"field {name!r}: a secret (repr=False) must be a str to be read from a file")
            kind = "secret"
        allowed = tuple(choices.get(name, literal))
        if allowed and kind == "str":
            kind = "choice"
        if name in defaults:
            default = defaults[name]
        elif f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        text = " ".join(t for t in (docs.get(name, ""), notes.get(name, "")) if t) or name.replace("_", " ")
        spec = FlagSpec(section=section, field=name, kind=kind, optional=optional, default=default, help=text,
                        aliases=tuple(aliases.get(name, ())), choices=allowed)
        env = env_names.get(name, env_prefix + spec.key.upper() if env_prefix else "")
        specs.append(dataclasses.replace(spec, env=env))
    return tuple(specs)


def _arg_type(spec: FlagSpec) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return spec.from_text(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = spec.kind
    return convert


class _RefuseSecretValue(argparse.Action):
    """``--<secret> VALUE``: an error that names the file flag and does not repeat the value."""

    def __init__(self, option_strings: list[str], dest: str, *, file_flag: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.file_flag = file_flag

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} is not accepted: a value on the command line shows in ps; put it in a file "
                     f"only you can read and pass {self.file_flag} PATH")


def add_flag(group: argparse._ActionsContainer, spec: FlagSpec) -> argparse.Action:
    """Put ``spec`` on ``group`` (a parser or an argument group); absent flags leave no attribute (SUPPRESS).

    A secret also gets a hidden ``--<name>`` that refuses a value, so it is not taken for an abbreviation of the
    file flag nor echoed back in an "unrecognized arguments" error.
    """
    common: dict[str, Any] = {"dest": spec.dest, "default": argparse.SUPPRESS, "help": spec.help_text()}
    if spec.kind == "secret":
        group.add_argument("--" + spec.field.replace("_", "-"), action=_RefuseSecretValue, dest=spec.dest + ".value",
                           file_flag=spec.flag)
    if spec.kind == "bool":
        return group.add_argument(*spec.option_strings, action=argparse.BooleanOptionalAction, **common)
    action = "append" if spec.kind in ("list", "dict") else "store"
    return group.add_argument(*spec.option_strings, action=action, type=_arg_type(spec), metavar=spec.metavar,
                              **common)


def given(args: argparse.Namespace, specs: Iterable[FlagSpec]) -> dict[str, Any]:
    """Field -> value for each of ``specs`` whose flag was on the command line."""
    out: dict[str, Any] = {}
    for spec in specs:
        if hasattr(args, spec.dest):
            value = getattr(args, spec.dest)
            if spec.kind == "dict":  # each occurrence gave (key, value) pairs; a later one wins
                value = {key: item for pairs in value for key, item in pairs}
            out[spec.field] = tuple(value) if spec.kind == "list" else value
    return out


def from_table(table: Mapping[str, Any], specs: Iterable[FlagSpec], *, where: str) -> dict[str, Any]:
    """Field -> value for a config file's table; ConfigError names a bad or unknown key (and the valid ones).

    Keys are the `FlagSpec.key` names (``-`` may stand for ``_``). A secret's value is refused: the file would
    hold it in the clear; the ``<name>_file`` key names a file that holds it.
    """
    by_key = {spec.key: spec for spec in specs}
    out: dict[str, Any] = {}
    for raw_key, value in table.items():
        key = raw_key.replace("-", "_")
        spec = by_key.get(key)
        if spec is None:
            secret = by_key.get(f"{key}_file")
            if secret is not None and secret.kind == "secret":
                raise ConfigError(f"{where}: {raw_key} cannot be written in a config file; put it in a file only "
                                  f"you can read and set {secret.key} = \"PATH\"")
            raise ConfigError(f"{where}: unknown key {raw_key!r}; valid keys: {', '.join(sorted(by_key))}")
        if spec.field in out:
            raise ConfigError(f"{where}: {spec.key} is given twice")
        try:
            out[spec.field] = spec.from_value(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: {raw_key}: {exc}") from None
    return out


def from_env(environ: Mapping[str, str], specs: Iterable[FlagSpec]) -> dict[str, Any]:
    """Field -> value for each of ``specs`` whose environment variable is set (and not empty) in ``environ``;
    ConfigError names the variable and says what it expected."""
    out: dict[str, Any] = {}
    for spec in specs:
        text = environ.get(spec.env, "") if spec.env else ""
        if not text.strip():
            continue
        try:
            out[spec.field] = spec.from_env_text(text)
        except ValueError as exc:
            raise ConfigError(f"environment variable {spec.env}: {exc}") from None
    return out


def _read_regular(path: str | Path, *, max_bytes: int, what: str) -> tuple[bytes, os.stat_result]:
    """The bytes of a regular file and its status (of the file read, not of a path looked up again).

    Opened without blocking, so a FIFO in its place cannot hang the start; ValueError says what is wrong.
    """
    p = Path(path).expanduser()
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ValueError(f"cannot read {what} {p}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{what} {p} is not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise ValueError(f"{what} {p} is larger than {max_bytes} bytes")
    return data, st


def _not_private(st: os.stat_result, path: str | Path, what: str) -> str | None:
    """Why a file is not private (as ssh judges a key): group or others may access it, or another user owns it."""
    if st.st_mode & 0o077:
        return (f"{what} {path} can be accessed by its group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                f"make it private: chmod 600 {path}")
    if hasattr(os, "getuid") and st.st_uid not in (os.getuid(), 0):
        return f"{what} {path} belongs to another user (uid {st.st_uid}); it must be yours (or root's)"
    return None


def read_private_file(path: str | Path, *, max_bytes: int, what: str) -> bytes:
    """The bytes of a regular file only its owner (you, or root) can access; ValueError otherwise."""
    data, st = _read_regular(path, max_bytes=max_bytes, what=what)
    problem = _not_private(st, path, what)
    if problem:
        raise ValueError(problem)
    return data


def read_secret_file(path: str | Path) -> str:
    """The secret in ``path``: a private file (see `read_private_file`), UTF-8, trailing newlines dropped."""
    data = read_private_file(path, max_bytes=MAX_SECRET_BYTES, what="secret file")
    try:
        secret = data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise ValueError(f"secret file {path} is not UTF-8 text") from None
    if not secret:
        raise ValueError(f"secret file {path} is empty")
    return secret


def load_toml(path: str | Path) -> tuple[dict[str, Any], str | None]:
    """A TOML file's tables, and why the file is not private (None if only its owner may access it).

    ``tomllib`` is in the standard library from Python 3.11; on 3.10 the ``tomli`` package stands in.
    """
    try:
        import tomllib  # type: ignore[import-not-found]
    except ModuleNotFoundError:
        try:
            import tomli as tomllib  # type: ignore[import-not-found,no-redef]
        except ModuleNotFoundError:
            raise ConfigError("reading a TOML config file needs Python 3.11+ or the tomli package "
                              "(pip install tomli)") from None
    try:
        data, st = _read_regular(path, max_bytes=MAX_CONFIG_BYTES, what="config file")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    try:
        table = tomllib.loads(data.decode("utf-8"))
    except ValueError as exc:  # tomllib.TOMLDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    return table, _not_private(st, path, "config file")
