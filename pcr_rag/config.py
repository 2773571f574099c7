"""`EngineConfig`: every knob of a `PCREngine`, validated up front. Capacities are bytes (ints or "2GiB" strings)."""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

from pcr_rag.cache.config import PLANNER_MODES, RemoteConfig, redacted_repr
from pcr_rag.cache.seal import SECRET_MIN_CHARS
from pcr_rag.errors import ConfigError
from pcr_rag.home import cache_home
from pcr_rag.limits import DEFAULT_LIMITS, RequestLimits
from pcr_rag.metrics import REUSE_MODES
from pcr_rag.model.weights import WEIGHT_FORMATS
from pcr_rag.sched.admission import SCHEDULES
from pcr_rag.sched.announcements import DEFAULT_MAX_PENDING, DEFAULT_MAX_PER_NAMESPACE
from pcr_rag.sched.step_budget import check_budget_steps
from pcr_rag.units import parse_bytes

EvictionPolicyName = Literal["lookahead-lru", "lru"]
LoadPlannerName = Literal["measured", "always-load"]  # pcr_rag.cache.config.PLANNER_MODES
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


_BOOL_FIELDS = ("layerwise", "prefetch", "enable_cache", "compile", "warmup", "freeze_gc", "remote_insecure",
                "remote_encrypt", "ssd_encrypt", "allow_download", "blend_backfill")
_STR_FIELDS = ("namespace", "remote_namespace", "schedule", "weights", "eviction", "load_planner", "reuse")


def _check_bool(name: str, value: object) -> None:
    """Flags are real bools: ``enable_cache="no"`` is truthy and ``1`` is ambiguous, so both are refused."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


def _check_int(name: str, value: object, *, minimum: int) -> None:
    """Counts are ints, never bools (``True`` is an int in Python, and ``chunk_size=True`` is a mistake)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_fraction(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{name} must be a fraction in [0, 1], got {value!r}")


def _check_seconds(name: str, value: object, *, positive: bool) -> None:
    """Durations are finite real numbers (NaN compares false with everything, so it would pass a bare ``<=``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"{name} must be {'>' if positive else '>='} 0, got {value!r}")


#: RemoteConfig field -> EngineConfig field, where the name is not ``remote_`` + the RemoteConfig name
_REMOTE_RENAMED = {"capacity_bytes": "remote_capacity"}
_REMOTE_ENGINE_OWNED = ("kv_layout",)  # derived from the loaded model, never configured


def _remote_fields() -> type:
    """A keyword-only dataclass of `EngineConfig`'s ``remote_*`` fields, generated from `RemoteConfig`'s own
    declarations (type, default, ``repr``), so the remote tier's settings are declared once.

    ``url`` (required by `RemoteConfig`) becomes the optional ``remote_url``: None means no remote tier.
    """
    hints = typing.get_type_hints(RemoteConfig)
    specs: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(RemoteConfig):
        if f.name in _REMOTE_ENGINE_OWNED:
            continue
        name = _REMOTE_RENAMED.get(f.name, f"remote_{f.name}")
        if f.default is dataclasses.MISSING:  # url
            specs.append((name, hints[f.name] | None, field(default=None, repr=f.repr)))
        else:
            specs.append((name, hints[f.name], field(default=f.default, repr=f.repr)))
    cls = dataclasses.make_dataclass("RemoteFields", specs, kw_only=True)
    cls.__module__ = __name__
    cls.__doc__ = "EngineConfig's remote_* fields, generated from RemoteConfig (see `_remote_fields`)."
    return cls


#: EngineConfig field -> RemoteConfig field
REMOTE_FIELDS: dict[str, str] = {_REMOTE_RENAMED.get(f.name, f"remote_{f.name}"): f.name
                                 for f in dataclasses.fields(RemoteConfig) if f.name not in _REMOTE_ENGINE_OWNED}
RemoteFields = _remote_fields()


def default_cache_dir() -> Path:
    """`$PCR_RAG_CACHE_DIR`, else `~/.cache/pcr-rag/kv`."""
    env = os.environ.get("PCR_RAG_CACHE_DIR")
    return Path(env).expanduser() if env else cache_home() / "kv"


@dataclass
class EngineConfig(RemoteFields):  # type: ignore[misc,valid-type]
    """Configuration of a `PCREngine`.

    The ``remote_*`` fields are `RemoteConfig`'s (declared there once, keyword-only here).

    Attributes:
        cache_dir: directory of the SSD tier (one engine per directory; a lock file enforces it).
        chunk_size: tokens per cached chunk; every document is cut into chunks of this size on its own.
        dram_capacity / ssd_capacity / device_capacity: tier budgets in bytes (or "2GiB"-style strings).
            ssd_capacity=0 disables the SSD tier; device_capacity is used only on CUDA.
        tenant_dram_quota / tenant_ssd_quota: per-tenant quotas of the DRAM and SSD tiers (bytes or "1GiB"; None =
            none). A chunk counts against the tenant (request namespace) whose request computed it; a tenant at its
            quota evicts only its own chunks, and with a capacity of at least the quota times the tenants holding
            bytes there, no tenant's insert evicts another's (`pcr_rag.cache.residency`).
        device: "auto" (CUDA if available), "cpu", "cuda", "cuda:N".
        dtype: "auto" (bfloat16 on CUDA and on CPUs with native bf16 (AVX512-BF16/AMX), else float32), a string
            or a torch dtype. Also the KV dtype.
        prefetch_window: number of waiting requests the prefetcher looks ahead at.
        layerwise: overlap loads/offloads with compute layer by layer (False: load all, compute, offload all).
        prefetch: start SSD -> DRAM loads for requests in the look-ahead window.
        eviction: "lookahead-lru" (protect what the window needs) or "lru".
        load_planner: "measured" (the default: a cached chunk is loaded only where that beats recomputing it, from each tier's
            measured read speed and the measured prefill speed: `pcr_rag.cache.reuse_planner`) or "always-load"
            (every cached chunk a tier can serve is loaded, however slow the tier).
        enable_cache: False runs the same chunk-aligned prefill without any reuse (the no-reuse baseline).
        reuse: "exact" (the default: only the exact prefix is reused, answers never depend on the cache) or
            "blend" (opt-in, approximate: documents after the exact prefix also reuse their position-independent
            KV wherever they appear, `pcr_rag.sched.blend`; each response reports ``blended_tokens``). A
            request may ask for either (``reuse=``).
        blend_recompute: in blend mode, the fraction of each placed document's tokens (its first ones) computed
            in context before the rest is placed (docs/blend.md has the quality each fraction measured).
        blend_verify: in blend mode, the fraction of blended requests that are also run exactly, as shadow
            requests, and compared (`pcr_rag.sched.blend_gate`); 0 = none.
        blend_backfill: in blend mode, a blended prompt that the exact prefix tree does not hold is also prefilled
            exactly once, on idle capacity (an exact twin of one output token, run when no request waits or runs),
            so that the same prompt coming back is served by exact reuse rather than blended again
            (`pcr_rag.sched.blend_gate`). Off by default: it spends idle compute, and it makes what a blend
            request reuses depend on whether the engine was idle in between.
        blend_gate_window / blend_gate_min_identical / blend_gate_max_kl: the gate over the last
            ``blend_gate_window`` verified requests of a namespace: when the share of greedy answers identical to
            exact falls below ``blend_gate_min_identical`` or the median first-token KL (nats) rises above
            ``blend_gate_max_kl``, that namespace's blend requests are served exactly from then on (logged,
            counted).
        namespace: tenant salt; caches of different namespaces never share chunks.
        max_new_tokens: default generation length (tokens).
        announce_ttl_s: an announced request that nobody claims expires after this many seconds.
        max_queue: waiting requests admitted at most; beyond it `generate` raises `QueueFullError`.
        max_active: KV rows, i.e. requests running at once (prefilling or decoding). Every decode step is one
            forward over exactly ``max_active`` rows (padding rows when fewer decode), so a request's numbers never
            depend on its batch company.
        max_model_len: tokens one row holds (prompt + generated); None = the model's context window (at most).
            A longer request raises `PromptTooLongError` before it takes a row.
        prefill_chunk_tokens: prompt tokens per prefill step (prefill is split-invariant, so the value never
            changes an answer).
        itl_budget_steps: an engine step runs only the prefill layers predicted to take at most
            ``itl_budget_steps - 1`` decode steps (a prefill step then spans several engine steps, same numbers),
            so a streamed token waits about this many decode steps at most (the ITL P99/P50 the engine plans for;
            `pcr_rag.sched.step_budget`), and a request admitted during a cold prefill step is ranked against it
            within that time (under ``cache-aware`` a hit need not wait out the cold step). A cold prompt's prefill
            shares the time with the decode steps it lets through. None = prefill steps always run whole between
            two decode steps.
        schedule: "fcfs" (arrival order) or "cache-aware" (least uncached work first, with aging; the
            `ORDER_HORIZON` oldest waiting requests are ranked, later ones wait in arrival order).
        weights: "bf16" (the model's own dtype), "int8" or "int4" weight-only quantization (CPU kernels PyTorch
            ships; falls back to the model dtype with a warning where unavailable). Part of the chunk keys' root.
        compile: True = `torch.compile` the forward's per-row pieces with static shapes (one graph per row count,
            shared by all layers; compiled during the warm-up, or by the first request without one, logged). Part of
            the chunk keys' root.
        warmup: run one prefill tile and one decode step on a scratch row when the engine starts, so the first
            request does not pay one-time kernel setup (oneDNN kernel generation and weight reorders, first-touch
            allocation, which would otherwise land on the first request's TTFT); then the tile and a decode step once
            more,
            timed, so the ITL budget, the aging rate and the load-or-recompute decision know the engine's speed from
            its first request (without, a new engine's first prefill steps run whole). Changes no number.
        freeze_gc: when the engine has started, collect garbage once and `gc.freeze()` what is alive (the model,
            the tokenizer, modules), so Python's full collections stop scanning it: that scan is a pause that
            otherwise stops every engine thread now and then (`pcr_rag.sched.gc_pauses`; undone when
            the engine closes). The collector is the whole process's, so off by default; ``pcr-rag serve``,
            ``demo`` and ``bench`` turn it on.
        io_workers: threads for SSD reads (prefetch and on-demand loads).
        model_cache_dir: where converted models are kept (None: the model loader's default).
        remote_url: a Valkey/Redis server shared by replicas, as a tier below SSD: "redis://[:password@]host:port/0",
            "rediss://..." (TLS), "valkey://..." / "valkeys://..."; or a Valkey/Redis Cluster:
            "redis+cluster://[:password@]host1:port,host2:port" (seed nodes; also "valkey+cluster://",
            "rediss+cluster://", "valkeys+cluster://"), one round trip per node a lookup involves and a breaker per
            node; None (the default) = no remote tier. Replicas share chunks when model, dtype, chunk size,
            weights, ``namespace`` and ``remote_namespace`` agree. Its password shows as ``***`` in every message
            and ``repr``; ``pcr-rag serve --remote-url-file PATH`` reads the URL from a file only its owner can
            read, so the password never shows in ``ps``.
        remote_capacity: bytes of remote values this engine tracks (the server's maxmemory bounds what it holds).
        remote_ttl_s: expiry of the values this engine writes (0 = none: the server's eviction policy decides).
        remote_namespace: prefix of every remote key ("<remote_namespace>:<chunk key hex>").
        remote_connect_timeout_s / remote_timeout_s: bound every connect / operation (seconds); a remote call
            never waits longer, and a failed one is a miss (the chunk is recomputed).
        remote_breaker_errors / remote_breaker_backoff_s: after this many consecutive remote errors the tier is
            skipped for the back-off (seconds) and requests run on the local tiers; then one trial call decides.
        remote_write_queue: chunks waiting to be written to the remote store; beyond it writes are dropped
            (counted), never waited for.
        remote_max_connections: connections the remote client pools (per node of a cluster).
        remote_secret: the replicas' shared secret (str, at least 16 characters) that authenticates every remote
            value (a keyed MAC over key, parent, namespace root, token digest, dtype, shape and payload); never
            written to the store. None reads ``$PCR_RAG_REMOTE_SECRET``. A ``remote_url`` without a secret refuses
            to start unless ``remote_insecure=True``.
        remote_insecure: accept a remote tier without a secret (values checked by unkeyed checksums only: anyone
            who can write to the store can change answers). One warning at start.
        remote_encrypt: also encrypt remote payloads (AES-GCM under a key derived from the secret per namespace
            root), so the store never holds KV in the clear. Needs a secret.
        system_prompt_scope: "shared" (default) or "private": the sharing scope of the template and system text
            before the first document (the chat template, system turns, the engine's instruction) in a request
            with a namespace. User and assistant turns and a raw prompt's text are never shared, and documents are
            private in such a request unless marked shared (`pcr_rag.Doc`); reuse is prefix-only, so tenants share
            the template head and the shared documents after it, and only when the first document is shared (a
            request without a shared document keeps its own keys, as before scopes). "private" shares nothing
            across namespaces; use it when system prompts are per user.
        token_cache_bytes: bytes the prompt builder's cache of tokenized pieces (texts, ids, learned layouts) may
            hold, across namespaces (or a "64MiB"-style string); only accepted requests fill it.
        ssd_encrypt: encrypt SSD chunk files the same way (AES-GCM, key derived from ``remote_secret`` or
            ``$PCR_RAG_REMOTE_SECRET``), so a reader of the cache directory learns nothing and a writer cannot
            forge a chunk. Needs a secret.
        allow_download: a model given as a Hugging Face repo id ("org/name") that is not in the local HF cache
            (``$HF_HOME/hub``) may be downloaded from the hub. Off by default: pcr-rag contacts no model hub, and
            a cached repo loads offline either way; ``HF_HUB_OFFLINE=1`` in the environment forbids downloads.
        chat_template: the chat template (Jinja, as a string or the path of a file holding it, as vLLM's
            ``--chat-template``) replacing the tokenizer's own; None keeps the tokenizer's. A model without one
            refuses chat requests (`pcr_rag.prompt.ChatTemplateMissingError`) unless this is ``"plain"``: chats
            are then rendered as plain text (base models such as ``gemma3-270m``). Changes the prompt text, so a
            new template means new prompt tokens, never stale KV.
        chat_template_kwargs: extra variables for the chat template in every chat (e.g.
            ``{"enable_thinking": False}``); a request's own ``ChatPrompt.chat_template_kwargs`` update them.
        max_stop_sequences / max_stop_bytes: stop strings a request may give, and UTF-8 bytes each may take
            (every stop string is matched on every token of the shared decode loop); more is refused before any
            compute (`pcr_rag.limits.RequestLimits`).
        max_format_bytes / max_tools_bytes: UTF-8 bytes of a request's response format (schema, regex or grammar)
            and of its tool definitions; more is refused before any grammar is built.
        max_announcements / max_announcements_per_namespace: announced requests pending on the engine's board,
            in all and per namespace (tenant); a new one beyond either bound evicts the oldest of its namespace
            (or of the board), so one tenant cannot fill the board.
    """

    cache_dir: str | Path | None = None
    chunk_size: int = 256
    dram_capacity: int | str = "2GiB"
    ssd_capacity: int | str = "16GiB"
    device_capacity: int | str = 0
    tenant_dram_quota: int | str | None = None
    tenant_ssd_quota: int | str | None = None
    device: str = "auto"
    dtype: Any = "auto"
    prefetch_window: int = 6
    layerwise: bool = True
    prefetch: bool = True
    eviction: EvictionPolicyName = "lookahead-lru"
    load_planner: LoadPlannerName = "measured"
    enable_cache: bool = True
    reuse: str = "exact"
    blend_recompute: float = 0.15
    blend_verify: float = 0.0
    blend_backfill: bool = False
    blend_gate_window: int = 16
    blend_gate_min_identical: float = 0.75
    blend_gate_max_kl: float = 0.5
    namespace: str = ""
    max_new_tokens: int = 128
    announce_ttl_s: float = 120.0
    max_queue: int = 4096
    max_active: int = 8
    max_model_len: int | None = 4096
    prefill_chunk_tokens: int = 256
    itl_budget_steps: float | None = 3.0
    schedule: str = "cache-aware"
    weights: str = "bf16"
    compile: bool = False
    warmup: bool = True
    freeze_gc: bool = False
    io_workers: int = 2
    model_cache_dir: str | Path | None = None
    ssd_encrypt: bool = False
    system_prompt_scope: str = "shared"
    token_cache_bytes: int | str = "64MiB"
    allow_download: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_stop_sequences: int = DEFAULT_LIMITS.max_stop_sequences
    max_stop_bytes: int = DEFAULT_LIMITS.max_stop_bytes
    max_format_bytes: int = DEFAULT_LIMITS.max_format_bytes
    max_tools_bytes: int = DEFAULT_LIMITS.max_tools_bytes
    max_announcements: int = DEFAULT_MAX_PENDING
    max_announcements_per_namespace: int = DEFAULT_MAX_PER_NAMESPACE
    extra: dict[str, Any] = field(default_factory=dict)

    def __repr__(self) -> str:
        return redacted_repr(self, ("remote_url",))

    def __post_init__(self) -> None:
        for name in _BOOL_FIELDS:
            _check_bool(name, getattr(self, name))
        for name in _STR_FIELDS:
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a str, got {getattr(self, name)!r}")
        _check_int("chunk_size", self.chunk_size, minimum=1)
        for name in ("dram_capacity", "ssd_capacity", "device_capacity", "token_cache_bytes"):
            if isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be bytes as an int or a string like '2GiB', not a bool")
            try:
                value = parse_bytes(getattr(self, name))
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{name}: {exc}; use bytes as an int or a string like '2GiB'") from exc
            if value < 0:
                raise ConfigError(f"{name} must be >= 0 bytes, got {value}")
            setattr(self, name, value)
        for name in ("tenant_dram_quota", "tenant_ssd_quota"):
            raw = getattr(self, name)
            if raw is None:
                continue
            try:
                if isinstance(raw, bool):
                    raise TypeError("a bool is not a size")
                value = parse_bytes(raw)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{name}: {exc}; use bytes as an int, a string like '1GiB', or None") from exc
            if value <= 0:
                raise ConfigError(f"{name} must be > 0 bytes or None (no quota), got {raw!r}")
            setattr(self, name, value)
        _check_int("prefetch_window", self.prefetch_window, minimum=0)
        if self.eviction not in ("lookahead-lru", "lru"):
            raise ConfigError(f"eviction must be 'lookahead-lru' or 'lru', got {self.eviction!r}")
        if self.load_planner not in PLANNER_MODES:
            raise ConfigError(f"load_planner must be one of {PLANNER_MODES}, got {self.load_planner!r}")
        if self.reuse not in REUSE_MODES:
            raise ConfigError(f"reuse must be one of {REUSE_MODES}, got {self.reuse!r}")
        for name in ("blend_recompute", "blend_verify", "blend_gate_min_identical"):
            _check_fraction(name, getattr(self, name))
        kl = self.blend_gate_max_kl
        if isinstance(kl, bool) or not isinstance(kl, (int, float)) or not (math.isfinite(kl) and kl > 0):
            raise ConfigError(f"blend_gate_max_kl must be a number of nats > 0, got {kl!r}")
        _check_int("blend_gate_window", self.blend_gate_window, minimum=1)
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        _check_seconds("announce_ttl_s", self.announce_ttl_s, positive=True)
        _check_seconds("remote_ttl_s", self.remote_ttl_s, positive=False)
        for name in ("remote_connect_timeout_s", "remote_timeout_s", "remote_breaker_backoff_s"):
            _check_seconds(name, getattr(self, name), positive=True)
        for name in ("max_queue", "max_active", "io_workers", "prefill_chunk_tokens", "remote_breaker_errors",
                     "remote_write_queue", "remote_max_connections"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("max_stop_sequences", "max_stop_bytes", "max_format_bytes", "max_tools_bytes",
                     "max_announcements", "max_announcements_per_namespace"):
            _check_int(name, getattr(self, name), minimum=1)
        check_budget_steps(self.itl_budget_steps)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, minimum=2)
        if self.system_prompt_scope not in ("shared", "private"):
            raise ConfigError(f"system_prompt_scope must be 'shared' or 'private', got {self.system_prompt_scope!r}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if self.weights not in WEIGHT_FORMATS:
            raise ConfigError(f"weights must be one of {list(WEIGHT_FORMATS)}, got {self.weights!r}")
        if self.remote_secret is not None and not isinstance(self.remote_secret, str):
            raise ConfigError("remote_secret must be a str (or None to read $PCR_RAG_REMOTE_SECRET)")
        if self.ssd_encrypt and self.secret is None:
            raise ConfigError("ssd_encrypt needs a secret: set remote_secret or $PCR_RAG_REMOTE_SECRET (a random "
                              "string of >= 16 characters)")
        if self.secret is not None and len(self.secret) < SECRET_MIN_CHARS:
            raise ConfigError(f"remote_secret (or $PCR_RAG_REMOTE_SECRET) must be at least {SECRET_MIN_CHARS} "
                              f"characters, got {len(self.secret)}")
        if not isinstance(self.device, str):
            raise ConfigError(f"device must be a str, got {self.device!r}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device={self.device!r} but CUDA is not available; use device='cpu' or 'auto'")
        self._check_chat_template()
        _ = self.torch_dtype  # validates
        _ = self.remote_config  # validates
        self.cache_dir = Path(self.cache_dir).expanduser() if self.cache_dir is not None else default_cache_dir()

    def _check_chat_template(self) -> None:
        """``chat_template`` names a template that compiles (or "plain"); ``chat_template_kwargs`` is a dict of
        JSON-like variables without the engine's own arguments."""
        from pcr_rag.model.model import PLAIN_TEMPLATE, read_chat_template
        from pcr_rag.prompt import check_template_kwargs

        if isinstance(self.chat_template, os.PathLike):
            self.chat_template = os.fspath(self.chat_template)
        try:
            if read_chat_template(self.chat_template) == PLAIN_TEMPLATE:
                self.chat_template = PLAIN_TEMPLATE  # " plain " too
            check_template_kwargs(self.chat_template_kwargs)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype == "auto":
            from pcr_rag.model.model import resolve_dtype

            return resolve_dtype("auto", self.torch_device)
        try:
            return _DTYPES[str(self.dtype).lower()]
        except KeyError:
            raise ConfigError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}") from None

    @property
    def request_limits(self) -> RequestLimits:
        """The bounds on one request's options (`pcr_rag.limits.RequestLimits`)."""
        return RequestLimits(self.max_stop_sequences, self.max_stop_bytes, self.max_format_bytes,
                             self.max_tools_bytes)

    @property
    def secret(self) -> str | None:
        """``remote_secret``, else ``$PCR_RAG_REMOTE_SECRET`` (None when neither is set)."""
        if self.remote_secret is not None:
            return self.remote_secret
        return os.environ.get("PCR_RAG_REMOTE_SECRET") or None

    @property
    def remote_config(self) -> RemoteConfig | None:
        """The remote tier's `RemoteConfig` (None without ``remote_url``); a `ConfigError` saying what to set when
        there is no secret and ``remote_insecure`` is off."""
        if self.remote_url is None:
            return None
        try:
            return RemoteConfig(**{name: getattr(self, field_name) for field_name, name in REMOTE_FIELDS.items()
                                   if name != "secret"}, secret=self.secret)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"remote tier: {exc}") from exc

    def with_overrides(self, **changes: Any) -> EngineConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


def with_chat_template(config: EngineConfig | None, chat_template: str | os.PathLike | None) -> EngineConfig | None:
    """``config`` (the defaults when None) with ``chat_template`` set, for wrappers that build an engine (the
    LangChain / LlamaIndex integrations' ``chat_template=``); ``config`` itself when ``chat_template`` is None.

    Raises:
        ConfigError: the template is bad, or ``config`` already names a different one.
    """
    if chat_template is None:
        return config
    chat_template = os.fspath(chat_template)
    if config is None:
        return EngineConfig(chat_template=chat_template)
    if config.chat_template is not None and config.chat_template != chat_template:
        raise ConfigError("chat_template is given twice (as an argument and in config), with different values; "
                          "pass one of them")
    return config.with_overrides(chat_template=chat_template)
