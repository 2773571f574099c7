"""LlamaIndex integration of pcr-rag: `PCRLLM` (KV-cache reuse) and its retrieval -> prefetch hook.

    from llama_index.llms.pcr import PCRLLM
    llm = PCRLLM(max_new_tokens=64)
    query_engine = index.as_query_engine(llm=llm)
    # opt-in cache-aware document order (the answer can differ from the relevance-ordered one):
    query_engine = index.as_query_engine(llm=llm, node_postprocessors=[PCRReorderPostprocessor(llm)])
"""

from llama_index.llms.pcr.base import PCRLLM, PCRRequestError
from llama_index.llms.pcr.embeddings import MiniLMEmbedding
from llama_index.llms.pcr.hook import install_retrieval_hook, retrieval_hook, uninstall_retrieval_hook
from llama_index.llms.pcr.reorder import PCRReorderPostprocessor

__all__ = ["PCRLLM", "MiniLMEmbedding", "PCRReorderPostprocessor", "PCRRequestError", "install_retrieval_hook",
           "retrieval_hook", "uninstall_retrieval_hook"]
