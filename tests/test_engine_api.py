"""Both engines serve the `Engine` surface (pcr_rag.engine_api): every member is there, every method takes the
protocol's parameters (by name and kind, with the same defaults), and `submit` gives the one `RequestHandle`.
Checked on the classes, statically: reading a property of `HTTPEngine` would call its server."""

from __future__ import annotations

import inspect
import re

import pytest

from pcr_rag.client.http import HTTPEngine
from pcr_rag.engine import PCREngine
from pcr_rag.engine_api import Engine
from pcr_rag.handle import RequestHandle

MEMBERS = sorted(n for n in vars(Engine) if not n.startswith("_"))


def _member(cls: type, name: str) -> object:
    return inspect.getattr_static(cls, name, None)


def test_the_protocol_names_what_the_integrations_use():
    assert {"submit", "announce", "cancel_announcement", "count_tokens", "close", "config", "loaded",
            "tokenizer", "context_window", "max_model_len", "closed"} <= set(MEMBERS)


@pytest.mark.parametrize("cls", [PCREngine, HTTPEngine])
@pytest.mark.parametrize("name", MEMBERS)
def test_each_engine_serves_each_member(cls, name):
    wanted = vars(Engine)[name]
    if isinstance(wanted, property):
        # a property or an attribute set in __init__ (then it is named there)
        assigned = re.search(rf"self\.{name}\b(: [^=]+)? = ", inspect.getsource(cls.__init__))
        assert _member(cls, name) is not None or assigned, f"{cls.__name__} has no {name}"
        return
    method = _member(cls, name)
    assert callable(method), f"{cls.__name__}.{name} is not a method"
    have = inspect.signature(method).parameters
    for param in inspect.signature(wanted).parameters.values():
        assert param.name in have, f"{cls.__name__}.{name} takes no {param.name!r}"
        got = have[param.name]
        assert got.kind == param.kind, f"{cls.__name__}.{name}({param.name}) is {got.kind}, not {param.kind}"
        assert got.default == param.default, f"{cls.__name__}.{name}({param.name}) defaults to {got.default!r}"
    extra = [p for p in have.values() if p.name not in inspect.signature(wanted).parameters
             and p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    assert not extra, f"{cls.__name__}.{name} needs {[p.name for p in extra]} the protocol does not pass"


@pytest.mark.parametrize("cls", [PCREngine, HTTPEngine])
def test_submit_returns_the_one_request_handle(cls):
    assert inspect.signature(cls.submit).return_annotation in ("RequestHandle", RequestHandle)
