"""Shapes of the transformer models the simulator and the device check size things for: `ModelShape` (the parts of
a config the cost model needs) and `MODELS`, from the models' published config.json files. Data only, below both
`pcr_rag.sim` and `pcr_rag.bench.device_check`."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MODELS", "ModelShape"]


@dataclass(frozen=True)
class ModelShape:
    """The parts of a transformer config the cost model needs.

    ``matmul_params_per_layer`` counts the weights one decoder layer multiplies each token by (attention
    projections + MLP); ``head_params`` the LM head (vocab x hidden). ``dtype_bytes`` is the KV/weight element size.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K and V of one token in one layer, bytes."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, bytes (what a chunk payload holds per token)."""
        return self.num_layers * self.kv_bytes_per_token_layer

    @property
    def matmul_params_per_layer(self) -> int:
        q_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return q_o + k_v + mlp

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Weights read per decode step (layers + LM head + embeddings), bytes."""
        return (self.num_layers * self.matmul_params_per_layer + 2 * self.head_params) * self.dtype_bytes


# Shapes from the models' published config.json files (fp16/bf16).
MODELS: dict[str, ModelShape] = {
    "llama2-7b": ModelShape("llama2-7b", 32, 32, 128, 32, 4096, 11008, 32000),
    "llama2-13b": ModelShape("llama2-13b", 40, 40, 128, 40, 5120, 13824, 32000),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 28, 4, 128, 28, 3584, 18944, 152064),
    "qwen2.5-14b": ModelShape("qwen2.5-14b", 48, 8, 128, 40, 5120, 13824, 152064),
    "llama3-8b": ModelShape("llama3-8b", 32, 8, 128, 32, 4096, 14336, 128256),
}
