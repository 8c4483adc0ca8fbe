"""Everything about Hugging Face models, in one package: the adapter that lets `generate` decode
with a transformers causal LM, and loading and identifying real weights. The draft heads trained
for a frozen Hugging Face target live in `specdec_models.heads`, their export formats in
`specdec_models.export`.

- `adapter`: `HFDecoder` (a causal LM seen through the `Decoder` protocol) with its per-row
  `HFKVCache`, `HFOutput`, `HFSizes`, `as_decoders`, `is_hf_model`; `text_config(config)` and
  `logits_width(model)`, the sizes every other module reads.
- `weights`: loading from a local directory or a GGUF file (`check_source`, `load_tokenizer`,
  `load_config`, `load_causal_lm`, `load_model`, `package_file`, `model_dir`),
  what a config says (`head_rows`, `max_positions`, `parameter_count`), identities
  (`weights_sha256`, `target_identity`, `tokenizer_fingerprint`, `vocabulary_fingerprint`,
  `model_dir_fingerprint`) and the
  tokenizer checks (`special_tokens`, `check_same_tokenizer`).

transformers is imported lazily: `specdec_models` and this package import without it. This package
imports no other package of specdec_models but the base modules (errors, files, config, model):
the heads import the adapter, the exports and their loading (`export.load`) the heads and weights.
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
    load_tokenizer,
    max_positions,
    model_dir,
    model_dir_fingerprint,
    package_file,
    parameter_count,
    special_tokens,
    target_identity,
    tokenizer_fingerprint,
    vocabulary_fingerprint,
    weights_sha256,
)

__all__ = [
    "HFDecoder", "HFKVCache", "HFOutput",
    "HFSizes", "LoadedModel", "as_decoders", "check_same_tokenizer", "check_source",
    "head_rows", "is_hf_model", "load_causal_lm", "load_config",
    "load_model", "load_tokenizer", "logits_width", "max_positions", "model_dir",
    "model_dir_fingerprint", "package_file", "parameter_count", "special_tokens", "target_identity",
    "text_config", "tokenizer_fingerprint", "vocabulary_fingerprint", "weights_sha256",
]
