"""Deprecated alias of `pcr_rag.cache.manager` (see `pcr_rag._moved`)."""

from pcr_rag._moved import alias_module

alias_module(__name__)
