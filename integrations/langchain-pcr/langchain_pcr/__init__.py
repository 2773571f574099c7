"""LangChain integration of pcr-rag: `ChatPCR`, `PCRLLM` and the retrieval hook `PCRRetrievalCallback`.

    from langchain_pcr import ChatPCR, PCRRetrievalCallback
    llm = ChatPCR(max_tokens=64)
    hook = PCRRetrievalCallback(llm)
    chain.invoke(question, config={"callbacks": [hook]})
    # opt-in cache-aware document order (the answer can differ from the relevance-ordered one):
    context = retriever | PCRReorder(llm) | format_docs
    # per-request instructions after the documents, so their KV stays reusable (it changes the prompt):
    chain = {"context": ..., "question": ..., "system_tail": ...} | rag_prompt() | llm
"""

from langchain_pcr.callbacks import (
    PCRRetrievalCallback,
    get_global_retrieval_hook,
    install_global_retrieval_hook,
    uninstall_global_retrieval_hook,
)
from langchain_pcr.chat_models import ChatPCR
from langchain_pcr.embeddings import MiniLMEmbeddings
from langchain_pcr.llms import PCRLLM
from langchain_pcr.prompts import rag_prompt
from langchain_pcr.reorder import PCRReorder

__version__ = "0.1.0"

__all__ = [
    "PCRLLM",
    "ChatPCR",
    "MiniLMEmbeddings",
    "PCRReorder",
    "PCRRetrievalCallback",
    "get_global_retrieval_hook",
    "install_global_retrieval_hook",
    "rag_prompt",
    "uninstall_global_retrieval_hook",
]
