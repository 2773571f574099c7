"""The client side of `pcr-rag serve`: `http` (`HTTPEngine`, the engine's surface over HTTP on the official
openai SDK), `wire` (the JSON each side sends), `routing` (the document-affinity key a replica set routes on) and
`handoff` (retrieved documents -> a prompt's documents, announcements at retrieval). Imports no torch,
transformers, model or scheduler module: `pip install pcr-rag` without extras runs it (an import-linter contract).
"""
