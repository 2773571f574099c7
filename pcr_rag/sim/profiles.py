"""Hardware + model profiles for the simulator's cost model.

A :class:`Profile` is flat and in plain units (seconds, bytes, bytes/s) so that a profile *measured* by
``pcr-rag profile`` and one *derived* from datasheet figures share one format and one JSON file layout.

Shipped profiles are derived, not measured: compute times come from FLOPs / (peak FLOP/s x an assumed
utilisation), decode from bytes read / (HBM bandwidth x an assumed utilisation), KV bytes per token from the model
configs. The assumptions are recorded in ``Profile.derivation`` so every figure a simulation prints can be traced
back to its inputs. Nothing here is a result.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pcr_rag.bench.model_shapes import MODELS, ModelShape

log = logging.getLogger(__name__)

GB = 1e9
#: How a prefill's new tokens split into forward steps (`pcr_rag.sim.simulator.SimConfig.prefill_steps`).
PREFILL_STEP_MODES: tuple[str, ...] = ("single", "engine", "per_chunk")
GiB = float(1 << 30)


class ProfileError(ValueError):
    """A profile name is unknown or a profile file is malformed; the message says which names/fields exist."""


@dataclass(frozen=True)
class Hardware:
    """Datasheet / commonly measured figures of one machine (GPU + host + NVMe)."""

    name: str
    peak_flops: float  # dense fp16/bf16 tensor FLOP/s
    prefill_mfu: float  # fraction of peak a prefill GEMM reaches
    attn_mfu: float  # fraction of peak flash-attention reaches
    hbm_bytes_per_s: float
    decode_mbu: float  # fraction of HBM bandwidth a decode step reaches
    device_mem_bytes: float
    device_mem_util: float  # vLLM gpu_memory_utilization
    activation_reserve_bytes: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    ssd_read_bytes_per_s: float
    ssd_write_bytes_per_s: float
    ssd_read_latency_s: float
    ssd_write_latency_s: float
    dram_bytes: float
    ssd_bytes: float
    layer_fixed_s: float  # kernel launches etc. per layer per forward step
    step_fixed_s: float  # embeddings, LM head launch, sampling, scheduler per forward step
    layer_sync_s: float  # event record/wait per layer when loads/offloads are pipelined


HARDWARE: dict[str, Hardware] = {
    # RTX 4090: 165 TFLOP/s dense fp16 tensor (fp32 accumulate), 1008 GB/s GDDR6X, 24 GB. PCIe 4.0 x16 and NVMe
    # sequential rates as the paper reports them.
    "rtx4090": Hardware(
        "rtx4090", 165e12, 0.5, 0.35, 1008e9, 0.7, 24 * GiB, 0.9, 1.5 * GiB, 24 * GB, 24 * GB,
        3 * GB, 3 * GB, 80e-6, 30e-6, 128 * GiB, 2000 * GB, 25e-6, 2e-3, 5e-6,
    ),
    # RTX A6000: 154.8 TFLOP/s dense fp16 tensor, 768 GB/s GDDR6, 48 GB; same host links as the 4090 box.
    "a6000": Hardware(
        "a6000", 154.8e12, 0.5, 0.35, 768e9, 0.7, 48 * GiB, 0.9, 2 * GiB, 24 * GB, 24 * GB,
        3 * GB, 3 * GB, 80e-6, 30e-6, 256 * GiB, 2000 * GB, 25e-6, 2e-3, 5e-6,
    ),
    # H200 SXM: datasheet compute and HBM3e bandwidth, PCIe Gen5 x16 pinned and Gen4 NVMe rates. The links and a
    # transformers prefill were checked on one H200 (`pcr-rag bench device`; figures in
    # docs/measurements-history.md#figures-moved-from-code-comments); pcr-rag's own runtime is launch-bound there,
    # so this profile models an optimised engine, not pcr-rag's runtime as it is.
    "h200": Hardware(
        "h200", 989e12, 0.45, 0.3, 4.8e12, 0.7, 141 * GB, 0.9, 4 * GiB, 55 * GB, 55 * GB,
        7 * GB, 5 * GB, 60e-6, 25e-6, 2048 * GiB, 8000 * GB, 15e-6, 1.5e-3, 4e-6,
    ),
}


@dataclass(frozen=True)
class Profile:
    """Everything the cost model needs, flat, in seconds / bytes / bytes per second.

    Prefill of one forward step that computes ``c`` new tokens after ``p`` tokens of context costs, per layer,
    ``layer_s_fixed + layer_s_per_token * c + layer_s_per_token_ctx * (c * p + c * (c + 1) / 2)`` (linear
    projections + causal attention pairs), plus ``step_s_fixed`` once per step. One decode step at context ``n``
    costs ``decode_s_per_token + decode_s_per_token_ctx * n``, plus ``decode_s_per_row`` for each row after the
    first when several sequences decode in one step (their own attention and row work; 0 where the step is weight
    bound and rows are nearly free, as on a GPU). ``request_overhead_s`` is added once to every
    prefill (work outside the model, measured by ``pcr-rag profile``). ``device_is_host`` means the model runs on the CPU:
    the DRAM tier *is* device memory and "loading" is a host memcpy at ``h2d_bytes_per_s``. ``loads_share_compute``:
    loads and offloads run on the cores the forward uses (a CPU with few cores), so they add to a prefill's time
    whether or not they are pipelined with it: a hit whose prefix comes from SSD takes longer than one from DRAM by
    more than its load waits (see docs/measurements-history.md#figures-moved-from-code-comments).
    """

    name: str
    description: str
    model: str
    num_layers: int
    kv_bytes_per_token: int
    layer_s_per_token: float
    layer_s_per_token_ctx: float
    layer_s_fixed: float
    step_s_fixed: float
    decode_s_per_token: float
    decode_s_per_token_ctx: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    ssd_read_bytes_per_s: float
    ssd_write_bytes_per_s: float
    ssd_read_latency_s: float
    ssd_write_latency_s: float
    device_kv_bytes: float
    dram_bytes: float
    ssd_bytes: float
    layer_sync_s: float = 0.0
    decode_s_per_row: float = 0.0  # per decoding row after the first, in one batched decode step
    request_overhead_s: float = 0.0  # per request, outside the model (tokenising, scheduling, hand-offs)
    device_is_host: bool = False
    loads_share_compute: bool = False
    prefill_steps: str = "single"  # "single": one forward; "engine": the runtime's steps; "per_chunk": per chunk
    source: str = "derived"
    derivation: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prefill_steps not in PREFILL_STEP_MODES:
            raise ProfileError(f"profile {self.name!r}: prefill_steps must be one of {list(PREFILL_STEP_MODES)}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float | int) and not isinstance(v, bool) and v < 0:
                raise ProfileError(f"profile {self.name!r}: {f.name} must be >= 0, got {v}")
        for f in ("h2d_bytes_per_s", "d2h_bytes_per_s", "ssd_read_bytes_per_s", "ssd_write_bytes_per_s"):
            if getattr(self, f) <= 0:
                raise ProfileError(f"profile {self.name!r}: {f} must be > 0")
        if self.num_layers <= 0 or self.kv_bytes_per_token <= 0:
            raise ProfileError(f"profile {self.name!r}: num_layers and kv_bytes_per_token must be > 0")

    @property
    def kv_bytes_per_token_layer(self) -> float:
        return self.kv_bytes_per_token / self.num_layers

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(self.to_json() + "\n")
        return p

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ProfileError(f"unknown profile fields {unknown}; known: {sorted(names)}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ProfileError(f"incomplete profile: {exc}") from exc


def derive_profile(hw: Hardware, model: ModelShape, *, name: str | None = None) -> Profile:
    """Turn datasheet figures into a :class:`Profile` (see the module docstring for the formulas)."""
    eff = hw.peak_flops * hw.prefill_mfu
    attn_eff = hw.peak_flops * hw.attn_mfu
    layer_s_per_token = 2.0 * model.matmul_params_per_layer / eff
    # QK^T and AV: 2 FLOPs x head_dim x heads each, per (query, key) pair.
    layer_s_per_token_ctx = 4.0 * model.num_heads * model.head_dim / attn_eff
    head_s = 2.0 * model.head_params / eff  # LM head on the last position only
    hbm = hw.hbm_bytes_per_s * hw.decode_mbu
    weights = model.weight_bytes
    kv_pool = hw.device_mem_bytes * hw.device_mem_util - weights - hw.activation_reserve_bytes
    if kv_pool <= 0:
        raise ProfileError(f"{model.name} ({weights / GB:.1f} GB of weights) does not fit on {hw.name}")
    return Profile(
        name=name or f"{hw.name}-{model.name}",
        description=f"{model.name} fp16 on {hw.name} (derived from datasheet figures)",
        model=model.name,
        num_layers=model.num_layers,
        kv_bytes_per_token=model.kv_bytes_per_token,
        layer_s_per_token=layer_s_per_token,
        layer_s_per_token_ctx=layer_s_per_token_ctx,
        layer_s_fixed=hw.layer_fixed_s,
        step_s_fixed=hw.step_fixed_s + head_s,
        decode_s_per_token=weights / hbm + hw.step_fixed_s + model.num_layers * hw.layer_fixed_s,
        decode_s_per_token_ctx=model.kv_bytes_per_token / hbm,
        h2d_bytes_per_s=hw.h2d_bytes_per_s,
        d2h_bytes_per_s=hw.d2h_bytes_per_s,
        ssd_read_bytes_per_s=hw.ssd_read_bytes_per_s,
        ssd_write_bytes_per_s=hw.ssd_write_bytes_per_s,
        ssd_read_latency_s=hw.ssd_read_latency_s,
        ssd_write_latency_s=hw.ssd_write_latency_s,
        device_kv_bytes=kv_pool,
        dram_bytes=hw.dram_bytes,
        ssd_bytes=hw.ssd_bytes,
        layer_sync_s=hw.layer_sync_s,
        device_is_host=False,
        prefill_steps="single",
        source="derived",
        derivation={"hardware": dataclasses.asdict(hw), "model": dataclasses.asdict(model)},
    )


# The paper's set-ups: Llama2-7B and Qwen2.5-7B on the RTX 4090 box, the 13B/14B models (too big for 24 GB) on the
# A6000 box; plus Llama-3-8B on both the 4090 (the paper's "Llama-8B on RTX 4090") and an H200.
_SHIPPED: dict[str, tuple[str, str]] = {
    "rtx4090-llama2-7b": ("rtx4090", "llama2-7b"),
    "rtx4090-qwen2.5-7b": ("rtx4090", "qwen2.5-7b"),
    "rtx4090-llama3-8b": ("rtx4090", "llama3-8b"),
    "a6000-llama2-7b": ("a6000", "llama2-7b"),
    "a6000-llama2-13b": ("a6000", "llama2-13b"),
    "a6000-qwen2.5-7b": ("a6000", "qwen2.5-7b"),
    "a6000-qwen2.5-14b": ("a6000", "qwen2.5-14b"),
    "h200-llama3-8b": ("h200", "llama3-8b"),
}


def shipped_profile_names() -> list[str]:
    return sorted(_SHIPPED)


def get_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name, or a JSON profile file (as written by ``pcr-rag profile``) by path."""
    key = str(name_or_path)
    if key in _SHIPPED:
        hw, model = _SHIPPED[key]
        return derive_profile(HARDWARE[hw], MODELS[model], name=key)
    path = Path(key)
    if path.suffix == ".json" or path.exists():
        if not path.exists():
            raise ProfileError(f"profile file {path} does not exist; create one with `pcr-rag profile --out {path}`")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ProfileError(f"profile file {path} is not valid JSON: {exc}") from exc
        return Profile.from_dict(data)
    raise ProfileError(f"unknown profile {key!r}; shipped: {', '.join(shipped_profile_names())}, or a JSON file path")
