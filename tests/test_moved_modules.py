"""Modules that moved keep their old names for one release: importing one warns and yields the new module itself."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from pcr_rag import _moved

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_module_name_warns_and_is_the_new_module(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {_moved.MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(_moved.MOVED[old])
    assert module.__name__ == _moved.MOVED[old]


def test_from_import_of_an_old_name_gets_the_new_objects():
    code = ("import warnings; warnings.simplefilter('error')\n"
            "try:\n    from pcr_rag.runtime.model import load_model\nexcept DeprecationWarning as w:\n"
            "    print('warned', w)\n"
            "warnings.simplefilter('ignore')\n"
            "from pcr_rag.runtime.model import load_model\nfrom pcr_rag.model.model import load_model as new\n"
            "print(load_model is new)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "warned pcr_rag.runtime.model moved to pcr_rag.model.model" in out and out.strip().endswith("True")


def test_every_shim_file_is_in_the_table_and_every_entry_has_its_shim():
    shims = set()
    for path in (ROOT / "pcr_rag").rglob("*.py"):
        if path.read_text().rstrip().endswith("alias_module(__name__)"):
            shims.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    assert shims == set(_moved.MOVED)
    for old, new in _moved.MOVED.items():
        assert importlib.util.find_spec(new) is not None, f"{old} points at {new}, which does not exist"


@pytest.mark.parametrize("old", sorted(_moved.SPLIT))
def test_a_split_module_warns_and_re_exports_the_public_names_of_its_parts(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} was split into"):
        module = importlib.import_module(old)
    for new in _moved.SPLIT[old]:
        part = importlib.import_module(new)
        for name in getattr(part, "__all__", ()):
            assert getattr(module, name) is getattr(part, name), f"{old}.{name} is not {new}.{name}"


@pytest.mark.parametrize("old", sorted(_moved.RENAMED))
def test_a_renamed_class_warns_and_is_the_new_class(old):
    module, name = old.rsplit(".", 1)
    new_module, new_name = _moved.RENAMED[old].rsplit(".", 1)
    with pytest.warns(DeprecationWarning, match=f"{name} is renamed"):
        value = getattr(importlib.import_module(module), name)
    assert value is getattr(importlib.import_module(new_module), new_name)
    with pytest.raises(AttributeError):
        _ = importlib.import_module(module).NoSuchName


def test_the_deprecated_names_reach_users_through_the_old_import_lines():
    code = ("import warnings; warnings.simplefilter('ignore')\n"
            "from pcr_rag.remote import RemoteEngine\nfrom pcr_rag.client.http import HTTPEngine\n"
            "from pcr_rag.cache import CacheEngine\nfrom pcr_rag.cache.manager import CacheManager\n"
            "print(RemoteEngine is HTTPEngine, CacheEngine is CacheManager)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.split() == ["True", "True"]
