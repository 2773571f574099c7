"""Deprecated alias of `pcr_rag.rag.demo` (see `pcr_rag._moved`)."""

from pcr_rag._moved import alias_module

alias_module(__name__)
