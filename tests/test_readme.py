"""The README runs as written: its ```python blocks are read from README.md itself (never copied here) and each one
runs in a fresh interpreter, in an empty folder, as a reader pasting it would run it.

A block preceded by ``<!-- readme-test: server ... -->`` talks to ``pcr-rag serve``: the test starts one on a free
port (with ``$PCR_RAG_API_KEY`` set, as the README's bash block does) and points the block's
``127.0.0.1:8000`` at it. Any other marker fails the test, so a block can never silently stop running.

The blocks load the default model, so running them is marked slow; the cheap checks (the README's length, its
links, that the blocks are found and marked) are not.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_LINES = 260  # the issue asks for "at most ~250": what a reader gets through in five minutes
SERVER_ADDRESS = "127.0.0.1:8000"
MARKER = re.compile(r"<!--\s*readme-test:\s*([\w-]+)")
KNOWN_NEEDS = {"server"}
# "N prompt tokens reused", "(N prompt tokens from the KV cache)", "...from the KV cache: N"
REUSE = re.compile(r"(\d+) prompt tokens (?:reused|from the KV cache)|from the KV cache: (\d+)")
BLOCK_TIMEOUT_S = 600  # model load + a few answers on a busy 2-core machine
SERVER_START_S = 400


@dataclass(frozen=True)
class Block:
    """One ```python block: where it starts (1-based line of its fence), its code, and what it needs."""

    line: int
    code: str
    needs: str | None

    @property
    def id(self) -> str:
        return f"line{self.line}" + (f"-{self.needs}" if self.needs else "")


def python_blocks(text: str) -> list[Block]:
    """Every fenced ```python block of ``text``, with the ``readme-test`` marker on the line before its fence."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            if j == len(lines):
                raise AssertionError(f"README.md:{start + 1}: a ```python block is never closed")
            before = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            marker = MARKER.search(before)
            blocks.append(Block(start + 1, "\n".join(lines[start + 1:j]) + "\n", marker.group(1) if marker else None))
            i = j
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text(encoding="utf-8"))


def _slug(heading: str) -> str:
    """MkDocs' (Python-Markdown toc) heading id, which GitHub's agrees with for plain headings."""
    text = re.sub(r"[^\w\s-]", "", heading).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/ (at most {MAX_LINES})"


def test_readme_links_resolve():
    """Every relative link (and image) of the README names a file or folder of the repository, and a ``#anchor``
    into a Markdown file names one of its headings."""
    text = README.read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    broken = []
    for target in targets:
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path if path else README
        if not file.exists():
            broken.append(f"{target}: no {path}")
            continue
        if anchor and file.suffix == ".md":
            headings = {_slug(h) for h in re.findall(r"^#+\s+(.+?)\s*$", file.read_text(encoding="utf-8"), re.M)}
            if anchor not in headings:
                broken.append(f"{target}: no heading #{anchor} in {path or 'README.md'}")
    assert not broken, "broken links in README.md:\n" + "\n".join(broken)


def test_readme_python_blocks_are_found_and_marked():
    """The parser finds the README's examples (LlamaIndex, LangChain, the server client, the engine), and every
    marker is one this test knows how to satisfy."""
    assert len(BLOCKS) >= 4, [b.id for b in BLOCKS]
    codes = "\n".join(b.code for b in BLOCKS)
    for name in ("SimpleDirectoryReader", "ChatPCR", "OpenAI(", "PCREngine("):
        assert name in codes, f"no README python block uses {name}"
    unknown = [b.id for b in BLOCKS if b.needs is not None and b.needs not in KNOWN_NEEDS]
    assert not unknown, f"README blocks with a readme-test marker this test does not know: {unknown}"
    for block in BLOCKS:
        compile(block.code, f"README.md:{block.line}", "exec")  # a syntax error fails here, before any model loads


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PCR_RAG_CACHE_DIR"] = str(tmp_path / "kv")  # never the user's cache (one engine per directory)
    env.update(extra)
    return env


def _run(block: Block, tmp_path: Path, env: dict[str, str]) -> str:
    script = tmp_path / "readme_block.py"
    script.write_text(block.code, encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([sys.executable, str(script)], cwd=work, env=env, capture_output=True, text=True,
                          timeout=BLOCK_TIMEOUT_S)
    assert proc.returncode == 0, (f"README.md:{block.line} failed ({proc.returncode}):\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    assert proc.stdout.strip(), f"README.md:{block.line} printed nothing"
    return proc.stdout


def _start_server(tmp_path: Path, key: str) -> tuple[subprocess.Popen[str], int]:
    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "pcr_rag.cli", "serve", "--port", str(port),
                             "--cache-dir", str(tmp_path / "serve-kv")],
                            env=_env(tmp_path, PCR_RAG_API_KEY=key), stdout=log, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"pcr-rag serve exited {proc.returncode}:\n"
                                 f"{(tmp_path / 'server.log').read_text()[-6000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            time.sleep(1.0)
    proc.kill()
    raise AssertionError(f"pcr-rag serve not healthy after {SERVER_START_S} s:\n"
                         f"{(tmp_path / 'server.log').read_text()[-6000:]}")


@pytest.mark.slow
@pytest.mark.timeout(BLOCK_TIMEOUT_S + SERVER_START_S + 120)
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_python_block_runs(block: Block, tmp_path: Path):
    if block.needs == "server":
        assert SERVER_ADDRESS in block.code, f"README.md:{block.line}: a server block must talk to {SERVER_ADDRESS}"
        key = "readme-test-key-0123456789"
        server, port = _start_server(tmp_path, key)
        try:
            code = block.code.replace(SERVER_ADDRESS, f"127.0.0.1:{port}")
            _run(Block(block.line, code, block.needs), tmp_path, _env(tmp_path, PCR_RAG_API_KEY=key))
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
        return
    out = _run(block, tmp_path, _env(tmp_path))
    reused = [int(a or b) for a, b in REUSE.findall(out)]
    if reused:  # a block that reports reuse shows some by its last report: the README's promise
        assert reused[-1] > 0, f"README.md:{block.line} reused nothing:\n{out}"
