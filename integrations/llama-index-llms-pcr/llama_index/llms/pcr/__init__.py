"""LlamaIndex integration of pcr-rag: `PCRLLM` (KV-cache reuse) and its retrieval -> prefetch hook.

    from llama_index.llms.pcr import PCRLLM
    llm = PCRLLM(max_new_tokens=64)
    query_engine = index.as_query_engine(llm=llm)
    # opt-in cache-aware document order (the answer can differ from the relevance-ordered one):
    query_engine = index.as_query_engine(llm=llm, node_postprocessors=[PCRReorderPostprocessor(llm)])
    # per-request instructions after the documents, so their KV stays reusable (it changes the prompt):
    query_engine = index.as_query_engine(llm=llm, text_qa_template=PCR_TEXT_QA_TEMPLATE)
    with system_tail("Today is ..."):
        query_engine.query("...")
"""

from llama_index.llms.pcr.base import PCRLLM, PCRRequestError
from llama_index.llms.pcr.embeddings import MiniLMEmbedding
from llama_index.llms.pcr.hook import install_retrieval_hook, retrieval_hook, uninstall_retrieval_hook
from llama_index.llms.pcr.reorder import PCRReorderPostprocessor
from llama_index.llms.pcr.templates import (
           PCR_SUMMARY_TEMPLATE,
           PCR_TEXT_QA_TEMPLATE,
           system_tail,
           with_system_tail,
)

__all__ = ["PCRLLM", "PCR_SUMMARY_TEMPLATE", "PCR_TEXT_QA_TEMPLATE", "MiniLMEmbedding", "PCRReorderPostprocessor",
           "PCRRequestError", "install_retrieval_hook", "retrieval_hook", "system_tail", "uninstall_retrieval_hook",
           "with_system_tail"]
