"""Document-affinity routing: a short key, computed client-side without the model, that names a request's leading
documents, so a load balancer that hashes on it (``X-PCR-Route``) sends every request whose prompt shares a KV
prefix to the same replica, whose DRAM then holds that prefix.

    from openai import OpenAI
    from pcr_rag.client.routing import ROUTE_HEADER, routing_key

    client.chat.completions.create(..., extra_body={"documents": docs},
                                   extra_headers={ROUTE_HEADER: routing_key(docs)})

`pcr_rag.HTTPEngine` sets the header on every request with documents (`prompt_route`; the integrations'
``base_url`` mode goes through it). It passes no ``namespace``: a client cannot tell whether the server separates
tenants, and the unkeyed hash travels next to the document's own text anyway; callers that want tenant-keyed
headers send their own. A request without documents carries no header: the proxy's fallback (round robin) takes
it.

What the key depends on, and why:

- **The first document only.** The prefix tree chains chunk keys: a prompt's chunks are the head's (the text
  before the first document: template, system prompt), then the first document's, then the second's, each keyed
  by everything before it. Two requests share KV beyond the head only when they share the first document (after
  the same head); requests that agree on the first document and differ later still share the first document's
  chunks. Hashing more documents would split those requests across replicas; hashing fewer (the head only) would
  send everything to one.
- **The head** (``system``): the text before the first document, when the caller knows it. The first document's
  KV under another head is another chain, so it may live elsewhere. Callers that cannot tell the head pass None
  (the head then counts as one and the same for every request: still exact affinity for one application, the
  common case). The head is every replica's anyway (it is the prefix of every request), so it decides nothing
  else.
- **The namespace, for documents that are not shared.** A document with scope "shared" is reused across
  tenants, so its key ignores ``namespace``. Any other first document under a namespace is reused only within
  it; its key is a keyed hash (BLAKE2b keyed by the namespace), so the header of a tenant's private document
  says nothing about its text to someone who does not know the tenant, and tenants spread over the replicas.
- **Normalization**: Unicode NFC and surrounding whitespace stripped (of the document and of the head). The
  prompt segmenter moves the whitespace around a document into the neighbouring pieces, so texts differing only
  there share most of their KV: routing them together loses nothing. Whitespace inside is kept.

Invariants: the key is 16 lowercase hex characters (64 bits of a BLAKE2b digest, personalised ``pcr-route-v1``):
never document text, safe in any header and in a proxy's log; equal inputs give equal keys in every process and
version of this module (the hash is not Python's randomized ``hash``). Collisions only make two documents share a
replica.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

from pcr_rag.errors import InvalidRequestError
from pcr_rag.prompt import Doc
from pcr_rag.request import ChatPrompt, FlatPrompt

__all__ = ["ROUTE_HEADER", "prompt_route", "routing_key"]

#: The request header a proxy hashes on (deploy/haproxy/: ``balance hdr(X-PCR-Route)``).
ROUTE_HEADER = "X-PCR-Route"
KEY_HEX_CHARS = 16
_PERSON = b"pcr-route-v1"
_MAX_KEY_BYTES = 64  # BLAKE2b's key limit: a longer namespace is hashed down first


def _normal(text: str) -> bytes:
    return unicodedata.normalize("NFC", text).strip().encode("utf-8")


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data  # length-prefixed: ("ab", "c") and ("a", "bc") differ


def routing_key(documents: Sequence[str | Doc], *, system: str | None = None, namespace: str | None = None) -> str:
    """The routing key of a request whose retrieved documents are ``documents``, in prompt order.

    Args:
        documents: the request's documents (str or `pcr_rag.Doc`), first one first; only the first counts.
        system: the text before the first document (system prompt, template head), or None when unknown.
        namespace: the tenant the request runs as (the server's namespace for its API key, when it separates
            tenants); ignored for a first document with scope "shared".
    Raises `InvalidRequestError` for no documents (send no header then) or a non-text document, system or
    namespace.
    """
    if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence):
        raise InvalidRequestError(f"documents must be a sequence of documents, got {type(documents).__name__}")
    if not documents:
        raise InvalidRequestError("a routing key needs at least one document; send no route header without any")
    first = documents[0]
    if isinstance(first, Doc):
        text, scope = first.text, first.scope
    elif isinstance(first, str):
        text, scope = first, None
    else:
        raise InvalidRequestError(f"documents[0] must be a str or a Doc, got {type(first).__name__}")
    if system is not None and not isinstance(system, str):
        raise InvalidRequestError(f"system must be a str or None, got {type(system).__name__}")
    if namespace is not None and not isinstance(namespace, str):
        raise InvalidRequestError(f"namespace must be a str or None, got {type(namespace).__name__}")
    key = b""
    if namespace and scope != "shared":
        key = namespace.encode("utf-8")
        if len(key) > _MAX_KEY_BYTES:
            key = hashlib.blake2b(key, digest_size=32, person=_PERSON).digest()
    h = hashlib.blake2b(digest_size=KEY_HEX_CHARS // 2, key=key, person=_PERSON)
    h.update(_field(_normal(system or "")))
    h.update(_field(_normal(text)))
    return h.hexdigest()


def prompt_route(prompt: ChatPrompt | FlatPrompt) -> dict[str, str]:
    """``{ROUTE_HEADER: key}`` for a prompt with documents, {} for one without (what `HTTPEngine` sends).

    The leading document is the one that occurs first in the prompt (the messages' contents in order, or the
    text), whatever the order of ``prompt.documents``, since that is where the KV chain leaves the head; the head
    is the text before it (`chat_head`, or a completion's ``system`` and the text before it). A prompt in which no
    document occurs routes by its first listed document, without a head."""
    if not prompt.documents:
        return {}
    scopes = prompt.scopes or (None,) * len(prompt.documents)
    best: tuple[tuple[int, int], int, str] | None = None  # ((message, offset), document index, head)
    for i, document in enumerate(prompt.documents):
        found = _locate(prompt, document)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], i, found[1])
    if best is None:
        return {ROUTE_HEADER: routing_key([Doc(prompt.documents[0], scopes[0])])}
    _, i, head = best
    return {ROUTE_HEADER: routing_key([Doc(prompt.documents[i], scopes[i])], system=head)}


def _locate(prompt: ChatPrompt | FlatPrompt, document: str) -> tuple[tuple[int, int], str] | None:
    """((message index, offset), head) of ``document``'s first occurrence in ``prompt``, or None."""
    if isinstance(prompt, ChatPrompt):
        before: list[str] = []
        for m, message in enumerate(prompt.messages):
            role, content = str(message.get("role", "")), _content_text(message.get("content"))
            at = content.find(document)
            if at >= 0:
                return (m, at), "\x00".join([*before, f"{role}\n{content[:at]}"])
            before.append(f"{role}\n{content}")
        return None
    at = prompt.text.find(document)
    return None if at < 0 else ((0, at), f"{prompt.system or ''}\x00{prompt.text[:at]}")


def _content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)
