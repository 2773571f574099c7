"""pcr-rag: prefix-tree KV-cache reuse with layer-wise overlap and queue-based prefetch for RAG serving."""

__version__ = "0.1.0"
