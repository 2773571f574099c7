"""Offline text corpora for RAG demos and benchmarks, and cutting them into retrieval passages.

Sources:

* ``None`` (the default): Python's standard-library documentation rendered with :mod:`pydoc` for a fixed, sorted
  list of pure-stdlib modules. Every machine with Python has it, nothing is downloaded, and the text is
  deterministic for a given Python version (memory addresses, file paths and module-level ``DATA`` values, which
  would leak the environment, are removed).
* a directory: every ``.txt`` / ``.md`` file below it (recursively, sorted by relative path).
* a ``.jsonl`` file: one ``{"id": ..., "title": ..., "text": ...}`` object per line (``text`` is required).

:func:`split_passages` cuts documents on paragraph boundaries into passages of about ``tokens_per_passage``
tokens (whitespace words when no tokenizer is given), the unit a retriever returns. :func:`section_titles`
lists the entry and section titles the documents themselves carry (pydoc classes, functions and methods;
Markdown headings), each with the passage that holds it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import pydoc
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger(__name__)

__all__ = [
    "STDLIB_MODULES",
    "CorpusDocument",
    "CorpusError",
    "CorpusNotFoundError",
    "EmptyCorpusError",
    "SectionTitle",
    "load_corpus",
    "section_titles",
    "split_passages",
    "stdlib_corpus",
]

#: Pure-Python (or always-built) standard-library modules whose pydoc text forms the default corpus. Sorted; the
#: order is part of the corpus identity (document i is always the same module).
STDLIB_MODULES: tuple[str, ...] = tuple(
    sorted(
        [
            "abc", "argparse", "base64", "bisect", "calendar", "collections", "colorsys", "contextlib", "copy",
            "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "fnmatch", "fractions", "functools",
            "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac", "html", "http", "io",
            "ipaddress", "itertools", "json", "keyword", "linecache", "locale", "logging", "math", "mimetypes",
            "numbers", "operator", "pathlib", "pickle", "pprint", "queue", "random", "re", "sched", "secrets",
            "shlex", "shutil", "statistics", "string", "struct", "textwrap", "threading", "timeit", "tokenize",
            "traceback", "types", "typing", "unittest", "uuid", "warnings", "weakref", "zipfile", "zlib",
        ]
    )
)

#: pydoc top-level sections dropped from the default corpus: environment-dependent or not prose.
_DROPPED_SECTIONS = frozenset({"DATA", "FILE", "MODULE REFERENCE"})
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{4,}")
_TEXT_SUFFIXES = (".txt", ".md")


class CorpusError(ValueError):
    """A corpus source cannot be used (bad format, unreadable); the message says what to fix."""


class CorpusNotFoundError(CorpusError, FileNotFoundError):
    """The named corpus source does not exist."""


class EmptyCorpusError(CorpusError):
    """The corpus source exists but holds no usable text."""


@dataclass(frozen=True)
class CorpusDocument:
    """One document (or passage) of a corpus. ``doc_id`` is unique within a corpus and stable across runs."""

    doc_id: str
    title: str
    text: str


def load_corpus(
    source: str | Path | None = None,
    *,
    max_docs: int | None = None,
    cache_dir: str | Path | None = None,
) -> list[CorpusDocument]:
    """Load documents from ``source`` (see the module docstring), at most ``max_docs`` of them, in a stable order.

    ``cache_dir`` only applies to the default stdlib corpus: the rendered text is kept there as JSONL so later
    loads skip pydoc. Raises :class:`CorpusNotFoundError` / :class:`EmptyCorpusError` / :class:`CorpusError`.
    """
    if max_docs is not None and max_docs < 1:
        raise CorpusError(f"max_docs must be >= 1 (or None for all), got {max_docs}")
    if source is None:
        docs = stdlib_corpus(max_docs=max_docs, cache_dir=cache_dir)
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise CorpusNotFoundError(
                f"corpus source {str(path)!r} does not exist; pass a directory of .txt/.md files, a .jsonl file "
                "with {\"id\", \"title\", \"text\"} lines, or nothing for the built-in stdlib corpus"
            )
        if path.is_dir():
            docs = _load_directory(path, max_docs)
        elif path.suffix.lower() == ".jsonl":
            docs = _load_jsonl(path, max_docs)
        elif path.suffix.lower() in _TEXT_SUFFIXES:
            docs = [_text_document(path, path.name)]
        else:
            raise CorpusError(
                f"corpus source {str(path)!r} is neither a directory, a .jsonl file nor a .txt/.md file"
            )
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise EmptyCorpusError(f"corpus source {source!r} holds no non-empty documents")
    return docs[:max_docs] if max_docs is not None else docs


def stdlib_corpus(
    modules: Sequence[str] = STDLIB_MODULES,
    *,
    max_docs: int | None = None,
    cache_dir: str | Path | None = None,
) -> list[CorpusDocument]:
    """The pydoc text of ``modules`` (in the given order), one document per module: ``doc_id`` ``stdlib/<name>``."""
    names = list(modules)[:max_docs] if max_docs is not None else list(modules)
    cache_file: Path | None = None
    if cache_dir is not None:
        ident = hashlib.blake2b(
            json.dumps([sys.version, names]).encode(), digest_size=8
        ).hexdigest()
        cache_file = Path(cache_dir).expanduser() / f"stdlib-corpus-{ident}.jsonl"
        if cache_file.is_file():
            try:
                return _load_jsonl(cache_file, None)
            except CorpusError as exc:  # a torn cache file is rebuilt, never trusted
                logger.warning("ignoring unreadable corpus cache %s: %s", cache_file, exc)
    docs = [CorpusDocument(f"stdlib/{name}", name, _render_module(name)) for name in names]
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        with tmp.open("w", encoding="utf-8") as fh:
            for d in docs:
                fh.write(json.dumps({"id": d.doc_id, "title": d.title, "text": d.text}) + "\n")
        tmp.replace(cache_file)
    return docs


def _render_module(name: str) -> str:
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise CorpusError(f"stdlib module {name!r} cannot be imported on this Python: {exc}") from exc
    text = pydoc.render_doc(module, renderer=pydoc.plaintext)
    return _clean_pydoc(text)


def _clean_pydoc(text: str) -> str:
    """Drop environment-dependent sections, mask memory addresses, strip trailing blanks."""
    out: list[str] = []
    keep = True
    for line in text.splitlines():
        if line and not line[0].isspace():  # a top-level section heading (or the title line)
            keep = line.strip() not in _DROPPED_SECTIONS
        if keep:
            out.append(_ADDRESS.sub("0x…", line.rstrip()))
    return "\n".join(out).strip() + "\n"


def _text_document(path: Path, doc_id: str) -> CorpusDocument:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path} is not UTF-8 text ({exc}); convert it or remove it from the corpus") from exc
    title = path.stem
    for line in text.splitlines():
        stripped = line.strip()
        if stripped:
            if stripped.startswith("#"):
                title = stripped.lstrip("#").strip() or title
            break
    return CorpusDocument(doc_id, title, text)


def _load_directory(path: Path, max_docs: int | None) -> list[CorpusDocument]:
    files = sorted(
        (p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _TEXT_SUFFIXES),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise EmptyCorpusError(f"directory {str(path)!r} contains no .txt or .md files")
    docs: list[CorpusDocument] = []
    for p in files:
        doc = _text_document(p, p.relative_to(path).as_posix())
        if doc.text.strip():
            docs.append(doc)
        if max_docs is not None and len(docs) >= max_docs:
            break
    return docs


def _load_jsonl(path: Path, max_docs: int | None) -> list[CorpusDocument]:
    docs: list[CorpusDocument] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj: Any = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise CorpusError(f"{path}:{lineno}: expected an object with a string \"text\" field")
            doc_id = str(obj.get("id", lineno))
            if doc_id in seen:
                raise CorpusError(f"{path}:{lineno}: duplicate id {doc_id!r}; ids must be unique")
            seen.add(doc_id)
            docs.append(CorpusDocument(doc_id, str(obj.get("title") or doc_id), obj["text"]))
            if max_docs is not None and len(docs) >= max_docs:
                break
    return docs


# --------------------------------------------------------------------------------------------------- passages


def _token_counter(tokenizer: Any) -> Callable[[str], int]:
    if tokenizer is None:
        return lambda text: len(text.split())
    if hasattr(tokenizer, "encode"):
        def count(text: str) -> int:
            try:
                return len(tokenizer.encode(text, add_special_tokens=False))
            except TypeError:
                return len(tokenizer.encode(text))

        return count
    if callable(tokenizer):
        return lambda text: int(tokenizer(text))
    raise TypeError("tokenizer must have .encode(text) or be a callable text -> token count")


def _paragraphs(text: str) -> list[str]:
    """Blocks separated by blank (whitespace-only) lines; internal line breaks and indentation preserved."""
    blocks: list[str] = []
    current: list[str] = []
    for line in text.splitlines():
        if line.strip():
            current.append(line.rstrip())
        elif current:
            blocks.append("\n".join(current))
            current = []
    if current:
        blocks.append("\n".join(current))
    return blocks


def _split_oversized(block: str, budget: int, count: Callable[[str], int]) -> list[str]:
    """Cut one block longer than ``budget`` on line boundaries, and a single overlong line on word boundaries."""
    pieces: list[str] = []
    units: list[str] = []
    for line in block.split("\n"):
        if count(line) <= budget:
            units.append(line)
            continue
        words = line.split(" ")
        part: list[str] = []
        for w in words:
            if part and count(" ".join([*part, w])) > budget:
                units.append(" ".join(part))
                part = []
            part.append(w)
        if part:
            units.append(" ".join(part))
    current: list[str] = []
    for unit in units:
        if current and count("\n".join([*current, unit])) > budget:
            pieces.append("\n".join(current))
            current = []
        current.append(unit)
    if current:
        pieces.append("\n".join(current))
    return pieces


def split_passages(
    docs: Iterable[CorpusDocument],
    *,
    tokens_per_passage: int = 300,
    tokenizer: Any = None,
) -> list[CorpusDocument]:
    """Cut documents into passages of at most ~``tokens_per_passage`` tokens, on paragraph boundaries.

    Paragraphs are packed greedily; a paragraph longer than the budget is cut on line, then word, boundaries.
    Token counts come from ``tokenizer.encode`` (or a callable returning a count), else whitespace words, so
    with no tokenizer the model-token length is only approximate (code-like text runs ~1.5-2 tokens per word).
    Passage ids are ``<doc_id>#<n>`` (n from 0), titles ``<title> (part n+1)``. Order: document order, then text
    order. Every non-blank line of the input appears in exactly one passage.
    """
    if tokens_per_passage < 8:
        raise ValueError(f"tokens_per_passage must be >= 8, got {tokens_per_passage}")
    count = _token_counter(tokenizer)
    out: list[CorpusDocument] = []
    for doc in docs:
        pieces: list[str] = []
        current: list[str] = []
        current_tokens = 0
        for block in _paragraphs(doc.text):
            n = count(block)
            if n > tokens_per_passage:
                if current:
                    pieces.append("\n\n".join(current))
                    current, current_tokens = [], 0
                pieces.extend(_split_oversized(block, tokens_per_passage, count))
                continue
            if current and current_tokens + n > tokens_per_passage:
                pieces.append("\n\n".join(current))
                current, current_tokens = [], 0
            current.append(block)
            current_tokens += n
        if current:
            pieces.append("\n\n".join(current))
        for i, piece in enumerate(pieces):
            out.append(CorpusDocument(f"{doc.doc_id}#{i}", f"{doc.title} (part {i + 1})", piece))
    return out


# ----------------------------------------------------------------------------------------------------- titles

_PYDOC_CLASS = re.compile(r"^    class ([A-Za-z]\w*)")
_PYDOC_FUNCTION = re.compile(r"^    ([A-Za-z]\w*)\(")
_PYDOC_METHOD = re.compile(r"^     \|  ([A-Za-z]\w*)\(")
_PYDOC_GROUP = re.compile(r"^     \|  ([A-Z][^()]*):$")  # "Methods defined here:", "Methods inherited from X:"
_PYDOC_RULE = re.compile(r"^     \|  -{10,}$")
_MARKDOWN_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")


@dataclass(frozen=True)
class SectionTitle:
    """A title a document carries: a pydoc ``class`` / ``function`` / ``method`` entry or a Markdown
    ``section`` heading. ``name`` is the entry's own name (``"decode"``) or the heading text; ``title`` is
    qualified with the document (and class): ``"json.JSONDecoder.decode"``. ``passage_id``: the passage whose
    text holds the title's line (its gold passage)."""

    passage_id: str
    document: str
    kind: Literal["class", "function", "method", "section"]
    name: str
    title: str


def section_titles(passages: Sequence[CorpusDocument]) -> list[SectionTitle]:
    """The titles in ``passages`` (as cut by :func:`split_passages`, in document and text order), first
    occurrence of each qualified title only.

    pydoc text (the stdlib corpus): a class under ``CLASSES`` (``    class Name(...)``), its own public methods
    (not the inherited ones, not the constructor signature line), and a public function under ``FUNCTIONS``. Markdown: ``#`` headings outside fenced
    code blocks. The section context (pydoc heading, current class, code fence) carries across the passages of
    one document, so pass all of a document's passages, not a sample of them.
    """
    out: list[SectionTitle] = []
    seen: set[str] = set()
    current_doc: str | None = None
    section = cls = ""
    inherited = fenced = False
    for passage in passages:
        doc = passage.doc_id.rsplit("#", 1)[0]
        if doc != current_doc:
            current_doc, section, cls, inherited, fenced = doc, "", "", False, False
        document = re.sub(r" \(part \d+\)$", "", passage.title)
        for line in passage.text.splitlines():
            found: tuple[Literal["class", "function", "method", "section"], str, str] | None = None
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if line and not line[0].isspace():
                section = line.strip()
                heading = _MARKDOWN_HEADING.match(line)
                if heading and not fenced:
                    found = ("section", heading.group(1), heading.group(1))
            elif section == "CLASSES":
                if m := _PYDOC_CLASS.match(line):
                    cls, inherited = m.group(1), False
                    found = ("class", cls, f"{document}.{cls}")
                elif m := _PYDOC_GROUP.match(line):
                    inherited = "inherited from" in m.group(1)
                elif _PYDOC_RULE.match(line):
                    inherited = False
                elif (m := _PYDOC_METHOD.match(line)) and cls and not inherited and m.group(1) != cls:
                    found = ("method", m.group(1), f"{document}.{cls}.{m.group(1)}")
            elif section == "FUNCTIONS" and (m := _PYDOC_FUNCTION.match(line)):
                found = ("function", m.group(1), f"{document}.{m.group(1)}")
            if found is not None and found[2] not in seen:
                seen.add(found[2])
                out.append(SectionTitle(passage.doc_id, document, found[0], found[1], found[2]))
    return out
