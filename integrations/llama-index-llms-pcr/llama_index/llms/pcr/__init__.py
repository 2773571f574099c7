"""LlamaIndex integration of pcr-rag: `PCRLLM` (KV-cache reuse) and its retrieval -> prefetch hook.

    from llama_index.llms.pcr import PCRLLM
    query_engine = index.as_query_engine(llm=PCRLLM(max_new_tokens=64))
"""

from llama_index.llms.pcr.base import PCRLLM, PCRRequestError
from llama_index.llms.pcr.embeddings import MiniLMEmbedding
from llama_index.llms.pcr.hook import install_retrieval_hook, retrieval_hook, uninstall_retrieval_hook

__all__ = ["PCRLLM", "MiniLMEmbedding", "PCRRequestError", "install_retrieval_hook", "retrieval_hook", "uninstall_retrieval_hook"]
