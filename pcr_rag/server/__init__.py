"""`pcr-rag serve`: an OpenAI-compatible HTTP server over one `PCREngine`, so many app processes share one engine
and one KV cache.

Modules: `settings` (`ServerSettings`), `errors` (OpenAI-shaped `APIError`), `auth` (API keys -> tenant
namespaces), `schemas` (request bodies as pydantic models, their parsing, response bodies), `translate` (a
generation body -> the engine call's inputs), `state` (`ServerState`: what the routes share), `routes` (one
`APIRouter` per endpoint group), `generation` (the generation routes' answers), `body`, `handlers`, `streaming`
(SSE that cancels on disconnect), `metrics` (Prometheus, ``pcr:`` prefix), `app` (`create_app`: the assembly),
`lifecycle` (`serve`, `ServerThread`), `cli` (the sub-command). Needs the ``serve`` extra (fastapi, uvicorn,
prometheus-client). The client side (integrations' ``base_url`` mode) is `pcr_rag.client.http`, which needs httpx
only.
"""

from pcr_rag.server.app import create_app
from pcr_rag.server.lifecycle import ServerThread, serve
from pcr_rag.server.settings import ServerSettings

__all__ = ["ServerSettings", "ServerThread", "create_app", "serve"]
