"""specdec_models: the pure-PyTorch side of specdec.

Models (a decoder with a per-row KV cache, a main decoder with its prophet), lossless
speculative decoding (`specdec_models.decode.generate`) and the export format
(`save_export` / `load_export`). Never imports lightning, hydra or wandb.
"""

from .config import ModelConfig, ProphetConfig
from .errors import SpecdecError
from .export import export_hash, load_export, save_export
from .heads import ModelWithProphet, ProphetLoss
from .kv_cache import KVCache
from .model import Decoder, DecoderOutput
from .sampling import SamplingConfig

__all__ = [
    "Decoder", "DecoderOutput", "KVCache", "ModelConfig", "ModelWithProphet", "ProphetConfig",
    "ProphetLoss", "SamplingConfig", "SpecdecError",
    "export_hash", "load_export", "save_export",
]
