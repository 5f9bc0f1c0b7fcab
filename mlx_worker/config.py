"""The engine's configuration: the `engine:` keys of deploy/app.yaml."""

from typing import Dict, List, Literal, Optional

from pydantic import Field

from .distributed.ranks import BACKENDS
from .memory.paging import PAGE_SIZE
from .speculative.config import SpeculativeConfig
from .strict_model import StrictModel


class EngineConfig(StrictModel):
    model: Optional[str] = None
    """HF id, mlx-lm directory or .gguf file; null: the embedded SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """auto (quantized on Metal, float32 on CPU) | quantized | float32 | float16 | bfloat16."""
    page_size: int = Field(PAGE_SIZE, ge=1)
    """Tokens per KV page: the unit of the pool, the prefix cache and the router's hashes."""
    max_total_tokens: Optional[int] = Field(None, ge=1)
    """KV pool size in tokens; overrides kv_memory_fraction."""
    kv_memory_fraction: float = Field(0.25, gt=0, le=0.95)
    """Share of the machine's memory (beyond the weights) given to the KV pool."""
    kv_bits: Optional[Literal[4, 8]] = None
    """Store KV pages quantized to this many bits (attention reads them with MLX's quantized kernels): about 2x (8) or 3.5x (4) the tokens in the same memory on Metal; null: the model's dtype."""
    kv_group_size: Literal[32, 64, 128] = 64
    """With kv_bits: elements of a head's K or V sharing one scale and bias."""
    prefix_cache_dir: Optional[str] = None
    """A directory (on an SSD) where the prefix cache keeps its pages too: they outlive memory evictions and restarts, and the replicas of one Mac share them; null: memory only."""
    prefix_cache_max_bytes: int = Field(64 << 30, ge=1)
    """What prefix_cache_dir may hold; the least recently used pages are deleted beyond it."""
    max_running_requests: int = Field(64, ge=1)
    """Requests in the batch at once; more wait in the engine's queue."""
    max_batched_tokens: int = Field(2048, ge=1)
    """Tokens per step at most: decode rows plus prefill chunks."""
    step_budget: Literal["time", "tokens"] = "time"
    """time: a step with decode rows prefills only as much as keeps it within the token gap; tokens: every step takes max_batched_tokens, whatever it costs."""
    max_token_gap_s: Optional[float] = Field(None, gt=0)
    """A step carrying decode rows stays within this many seconds; null: 3x the decode-only step of its rows, as the measured step cost predicts it."""
    min_prefill_tokens: int = Field(256, ge=1)
    """Prompt tokens a step prefills however short the gap, so prompts always move."""
    decode_staging_fraction: float = Field(0.5, ge=0)
    """A dense copy of the decode batch's KV, as a multiple of the KV memory budget; 0: off."""
    state_snapshot_fraction: float = Field(0.1, ge=0)
    """Recurrent-state snapshots (the prefix cache of hybrid models), as a multiple of the KV memory budget."""
    batching: Literal["auto", "ragged", "ragged_head_groups", "uniform_offsets"] = "auto"
    """How rows at different positions share a forward; auto: probed on the model at load."""
    overlap: bool = True
    """Build the next step while the device runs this one; false: one at a time (debugging)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Macs one replica spans, each holding a slice of every layer."""
    pipeline_parallel_size: int = Field(1, ge=1)
    """Or: Macs one replica spans, each holding a run of whole layers."""
    distributed_backend: Literal[BACKENDS] = "ring"
    """Between a replica's Macs: ring (TCP over Ethernet or Thunderbolt IP) or jaccl (RDMA over Thunderbolt 5)."""
    rdma_devices: Optional[List[List[Optional[str]]]] = None
    """jaccl only: rank i's RDMA device towards rank j."""
    request_timeout_s: Optional[float] = Field(None, gt=0)
    """Refuse at once (429 + Retry-After) a request that cannot finish within its client's timeout (X-Request-Timeout, or the SDKs' own header), else within this; null: admit all."""
    adapters: Dict[str, str] = Field(default_factory=dict)
    """LoRA adapters this engine serves beside its base model: name -> directory (mlx-lm's format or PEFT's)."""
    max_loaded_adapters: int = Field(8, ge=1)
    """Adapters resident at once; the least recently used one with no request in flight makes room for another."""
    image_cache_bytes: int = Field(256 << 20, ge=0)
    """Vision models: the features of recently encoded images kept (by image hash, least recently used out), so that an image sent again is not encoded again; 0: off."""
    speculative: Optional[SpeculativeConfig] = None
    """Speculative decoding (method, num_draft_tokens, adaptive); null: off. The same tokens, greedy or seeded, sooner where drafts are right."""
