"""Everything about Hugging Face models, in one package: the adapter that lets `generate` decode
with a transformers causal LM, and loading and identifying real weights. The draft heads trained
for a frozen Hugging Face target live in `specdec_models.heads`, their export formats in
`specdec_models.export`.

- `adapter`: `HFDecoder` (a causal LM seen through the `Decoder` protocol) with its per-row
  `HFKVCache`, `HFOutput`, `HFSizes`, `as_decoders`, `is_hf_model`; `text_config(config)` and
  `logits_width(model)`, the sizes every other module reads.
- `weights`: loading from a local directory or a GGUF file (`check_source`, `load_tokenizer`,
  `load_config`, `load_causal_lm`, `load_model`, `smollm2_gguf`, `load_smollm2`, `model_dir`),
  what a config says (`head_rows`, `max_positions`, `parameter_count`), identities
  (`weights_sha256`, `target_identity`, `tokenizer_fingerprint`, `vocabulary_fingerprint`,
  `model_dir_fingerprint`) and the
  tokenizer checks (`special_tokens`, `check_same_tokenizer`).
- `run`: the decoding CLI's loading of a target with a draft or a head (`load_hf_run`).

transformers is imported lazily: `specdec_models` and this package import without it. The adapter
imports no head; the heads import the adapter. `run` reads exports (`specdec_models.export`,
which itself imports the heads), so its names load on first use.
"""

from .adapter import HFDecoder, HFKVCache, HFOutput, HFSizes, as_decoders, is_hf_model, logits_width, text_config
from .weights import (
    LoadedModel,
    check_same_tokenizer,
    check_source,
    head_rows,
    load_causal_lm,
    load_config,
    load_model,
    load_smollm2,
    load_tokenizer,
    max_positions,
    model_dir,
    model_dir_fingerprint,
    parameter_count,
    smollm2_gguf,
    special_tokens,
    target_identity,
    tokenizer_fingerprint,
    vocabulary_fingerprint,
    weights_sha256,
)

_LAZY = {"HFRun": "run", "encode_prompt": "run", "load_hf_run": "run"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [  # HFRun, encode_prompt, load_hf_run: loaded on first use
    "HFDecoder", "HFKVCache", "HFOutput", "HFRun",
    "HFSizes", "LoadedModel", "as_decoders", "check_same_tokenizer", "check_source",
    "encode_prompt", "head_rows", "is_hf_model", "load_causal_lm", "load_config",
    "load_hf_run", "load_model", "load_smollm2", "load_tokenizer", "logits_width", "max_positions", "model_dir",
    "model_dir_fingerprint", "parameter_count", "smollm2_gguf", "special_tokens", "target_identity",
    "text_config", "tokenizer_fingerprint", "vocabulary_fingerprint", "weights_sha256",
]
