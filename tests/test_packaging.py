"""Packaging tells the truth.

- Core dependencies ([project].dependencies) are what the engine imports: every module-level import of the engine's
  modules is satisfied by them (and what they depend on), and each of them is imported by the engine. The server,
  the benchmarks and the HTTP client (`pcr_rag.remote`) are extras' business.
- A remote tier without the ``redis`` package (the ``remote`` extra) is refused with the command that installs it.
- (slow) pcr-rag and each integration build from their folders and install, offline, into a fresh virtual
  environment; see `test_integrations_install_from_their_folders_offline` for what that proves.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pcr_rag.cache.config import RemoteConfig
from pcr_rag.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pcr_rag"
INTEGRATIONS = {"langchain-pcr": "langchain_pcr", "llama-index-llms-pcr": "llama_index.llms.pcr"}
# Not the engine: the HTTP server (extra "serve"), the benchmarks (extra "bench") and the HTTP client RemoteEngine
# (extra "client", which both integrations require).
NOT_ENGINE = ("server", "bench", "remote.py", "remote_wire.py")


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _core() -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in _project()["dependencies"]}


def _closure(names: set[str]) -> set[str]:
    """``names`` and everything they require, with the extras each requirement asks for, from the installed
    distributions' metadata."""
    seen: set[tuple[str, str]] = set()
    stack = [(canonicalize_name(n), "") for n in names]
    while stack:
        name, extra = stack.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": extra}):
                dep = canonicalize_name(req.name)
                stack.extend([(dep, "")] + [(dep, e) for e in req.extras])
    return {name for name, _ in seen}


def _engine_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if not any(part in NOT_ENGINE for part in p.relative_to(PACKAGE).parts)]


def _imports(tree: ast.Module, *, top_level_only: bool) -> set[str]:
    """Top-level module names imported by ``tree``: at module level (outside ``if TYPE_CHECKING``), or anywhere."""
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    if top_level_only:
        visit(tree.body)
    else:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                visit([node])
    return found


def _third_party(modules: set[str]) -> set[str]:
    return {m for m in modules if m not in sys.stdlib_module_names and m not in ("pcr_rag", "__future__")}


def test_engine_module_level_imports_are_core_dependencies() -> None:
    dists = packages_distributions()
    allowed = _closure(_core())
    missing = {}
    for path in _engine_modules():
        for module in _third_party(_imports(ast.parse(path.read_text()), top_level_only=True)):
            owners = {canonicalize_name(d) for d in dists.get(module, [module])}
            if not owners & allowed:
                missing.setdefault(module, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"engine modules import these at module level, but no core dependency provides them " \
                        f"(add the dependency, or import it where it is used and name its extra): {missing}"


def test_every_core_dependency_is_imported_by_the_engine() -> None:
    dists = packages_distributions()
    imported: set[str] = set()
    for path in _engine_modules():
        for module in _third_party(_imports(ast.parse(path.read_text()), top_level_only=False)):
            imported.update(canonicalize_name(d) for d in dists.get(module, [module]))
    unused = _core() - imported
    assert not unused, f"core dependencies nothing in the engine imports (move them to an extra or drop them): " \
                       f"{sorted(unused)}"


def test_extras_hold_what_moved_out_of_core() -> None:
    extras = {name: {canonicalize_name(Requirement(r).name) for r in reqs}
              for name, reqs in _project()["optional-dependencies"].items()}
    assert {"matplotlib", "tqdm"} <= extras["bench"] and "redis" in extras["remote"]
    assert {"fastapi", "uvicorn"} <= extras["serve"] and "cryptography" in extras["crypto"]
    assert "openai" in extras["client"]
    everything = set().union(*extras.values()) | _core()
    assert not {"sentence-transformers", "accelerate"} & everything
    install = next(line for line in (ROOT / "Makefile").read_text().splitlines() if '-e ".[' in line)
    installed = set(install.split('-e ".[', 1)[1].split("]", 1)[0].split(","))
    assert installed == set(extras), f"make install must install every extra: {install}"


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "valkey+cluster://127.0.0.1:1"])
def test_remote_tier_without_redis_names_the_extra(monkeypatch, url) -> None:
    from pcr_rag.cache.tiers.remote_store import open_store

    for name in [m for m in sys.modules if m == "redis" or m.startswith("redis.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` now fails as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install 'pcr-rag\[remote\]'"):
        open_store(RemoteConfig(url, insecure=True))


# ------------------------------------------------------------------------------------------------ offline install
def _copy_source(src: Path, dst: Path, names: list[str]) -> Path:
    """The files a build reads (``names`` under ``src``), copied so the build writes nothing into the tree."""
    import shutil

    dst.mkdir(parents=True)
    for name in names:
        path = src / name
        if path.is_dir():
            shutil.copytree(path, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "tests"))
        else:
            shutil.copy2(path, dst / name)
    return dst


def _installed_files(site: Path) -> dict[str, list[str]]:
    """Each distribution installed in ``site`` (canonical name) -> its files (RECORD paths, relative to ``site``)."""
    import csv

    files: dict[str, list[str]] = {}
    for info in site.glob("*.dist-info"):
        record = info / "RECORD"
        if record.is_file():
            name = canonicalize_name(info.name[: -len(".dist-info")].rsplit("-", 1)[0])
            with record.open(newline="") as fh:
                files[name] = [row[0] for row in csv.reader(fh) if row and not row[0].startswith("..")]
    return files


def _link_base(base: Path, names: set[str]) -> None:
    """Symlink the installed files of the distributions ``names`` (from this interpreter's environment) under
    ``base``: a top-level entry whole when no other installed distribution has files under it, else file by file
    (namespace packages such as ``llama_index`` hold other distributions' modules)."""
    site = Path(sysconfig.get_paths()["purelib"])
    files = _installed_files(site)
    owners: dict[str, set[str]] = {}
    for name, paths in files.items():
        for top in {p.split("/", 1)[0] for p in paths}:
            owners.setdefault(top, set()).add(name)
    for name in names:
        assert name in files, f"{name} is not installed in {site}"
        for rel in files[name]:
            top = rel.split("/", 1)[0]
            whole = owners[top] <= names
            target = base / (top if whole else rel)
            if rel.endswith(".pth") or target.is_symlink():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(site / (top if whole else rel))


def _run(cmd: list[str], **kwargs) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


ENGINE_SMOKE = """
import importlib.util, sys
import pcr_rag, langchain_pcr, llama_index.llms.pcr as li
from pathlib import Path
from pcr_rag import EngineConfig, PCREngine
from pcr_rag.testing import tiny_model
site = Path(sys.argv[1]).resolve()
for mod in (pcr_rag, langchain_pcr, li):  # installed copies, not the repository's
    assert site in Path(mod.__file__).resolve().parents, mod.__file__
    assert mod is pcr_rag or (Path(mod.__file__).parent / "py.typed").is_file()
absent = [m for m in ("matplotlib", "redis", "fastapi", "accelerate", "sentence_transformers")
          if importlib.util.find_spec(m) is not None]
assert not absent, absent
model, tokenizer = tiny_model("llama", seed=0)
with PCREngine(model, tokenizer, config=EngineConfig(cache_dir=sys.argv[2], chunk_size=16, max_new_tokens=3,
                                                     dram_capacity="16MiB", ssd_capacity="16MiB")) as engine:
    from langchain_pcr import ChatPCR
    from llama_index.llms.pcr import PCRLLM
    a = ChatPCR(engine=engine).invoke("hello").content
    b = PCRLLM(engine=engine, retrieval_hook=False).complete("hello").text
    assert a == b == engine.generate_messages([{"role": "user", "content": "hello"}]).text
print("ok")
"""


@pytest.mark.slow
def test_integrations_install_from_their_folders_offline(tmp_path) -> None:
    """What it proves: pcr-rag and both integrations build as wheels from their folders (``pip wheel --no-deps``
    of the folder's files); a fresh virtual environment (no system site-packages) with pip's ``--no-index`` (no
    network, nothing downloaded) installs pcr-rag, then each integration, whose declared dependencies resolve to the
    pcr-rag wheel and to packages already present; ``pip check`` passes; the installed copies (not the repository's)
    import, ship py.typed, and answer through a tiny engine, while the extras' packages (matplotlib, redis, fastapi)
    are absent. The third-party packages are this environment's installed files, made visible to the fresh one
    through a .pth file, and only the dependency closure each step declares: core dependencies first, the
    integrations' (LlamaIndex, LangChain, the openai client) second. Not proved: that PyPI resolves the same
    versions."""
    wheels = tmp_path / "wheels"
    sources = tmp_path / "src"
    folders = [_copy_source(ROOT, sources / "pcr-rag", ["pyproject.toml", "README.md", "pcr_rag"])]
    for folder, package in INTEGRATIONS.items():
        src = ROOT / "integrations" / folder
        folders.append(_copy_source(src, sources / folder, ["pyproject.toml", "README.md", package.split(".")[0]]))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
          *map(str, folders)])
    assert len(list(wheels.glob("*.whl"))) == 3

    env = tmp_path / "venv"  # no pip and no setuptools of its own: this environment's pip installs into it
    _run([sys.executable, "-m", "venv", "--without-pip", str(env)])
    py = str(env / "bin" / "python")
    site = Path(_run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    pip = [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-index", "--find-links", str(wheels)]
    check = [sys.executable, "-m", "pip", "--python", py, "check"]

    core = _closure(_core())
    _link_base(tmp_path / "base-core", core)
    (site / "pcr-test-base-core.pth").write_text(str(tmp_path / "base-core") + "\n")
    _run([*pip, "pcr-rag"])
    _run(check)

    project = _project()
    client = {canonicalize_name(Requirement(r).name) for r in project["optional-dependencies"]["client"]}
    integration_deps = set(client)
    for folder in INTEGRATIONS:
        meta = tomllib.loads((ROOT / "integrations" / folder / "pyproject.toml").read_text())["project"]
        integration_deps |= {canonicalize_name(Requirement(r).name) for r in meta["dependencies"]} - {"pcr-rag"}
    _link_base(tmp_path / "base-integrations", _closure(integration_deps) - core)
    (site / "pcr-test-base-integrations.pth").write_text(str(tmp_path / "base-integrations") + "\n")
    _run([*pip, *INTEGRATIONS])
    _run(check)
    assert _run([py, "-c", ENGINE_SMOKE, str(site), str(tmp_path / "kv")], cwd=tmp_path).strip().endswith("ok")


@pytest.mark.parametrize(("argv", "hidden", "extra"), [(["bench"], "matplotlib", "bench"),
                                                      (["serve"], "fastapi", "serve")])
def test_a_subcommand_without_its_extra_names_it(monkeypatch, capsys, argv, hidden, extra) -> None:
    from pcr_rag.cli import main

    for name in [m for m in sys.modules
                 if m.split(".")[0] == hidden or m.startswith(("pcr_rag.bench", "pcr_rag.server"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, hidden, None)  # as if the extra were not installed
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert f"pcr-rag {argv[0]} needs the {hidden} package" in err and f"pip install 'pcr-rag[{extra}]'" in err
