"""Everything about Hugging Face models, in one package: the adapter that lets `generate` decode
with a transformers causal LM, loading and identifying real weights, the draft heads trained for a
frozen Hugging Face target, and their exports.

- `adapter`: `HFDecoder` (a causal LM seen through the `Decoder` protocol) with its per-row
  `HFKVCache`, `HFOutput`, `HFSizes`, `as_decoders`, `is_hf_model`; `text_config(config)` and
  `logits_width(model)`, the sizes every other module reads.
- `weights`: loading from a local directory or a GGUF file (`check_source`, `load_tokenizer`,
  `load_config`, `load_causal_lm`, `load_model`, `smollm2_gguf`, `load_smollm2`, `model_dir`),
  what a config says (`head_rows`, `max_positions`, `parameter_count`), identities
  (`weights_sha256`, `target_identity`, `tokenizer_fingerprint`, `model_dir_fingerprint`) and the
  tokenizer checks (`special_tokens`, `check_same_tokenizer`).
- `prophet`: `HFProphet`, a prophet head on the target's last-layer hidden states.
- `eagle3`: `Eagle3Head`, an EAGLE-3 head on three of the target's layers, and its draft vocabulary.
- `eagle3_export`: an eagle3 head in specdec's, vLLM's (speculators) and SGLang's layouts.
- `run`: the decoding CLI's loading of a target with a draft or a head (`load_hf_run`).

transformers is imported lazily: `specdec_models` and this package import without it. The adapter
imports no head; the heads import the adapter. `eagle3_export` and `run` read and write exports
(`specdec_models.export`, which itself imports the heads from here), so their names load on
first use.
"""

from .adapter import HFDecoder, HFKVCache, HFOutput, HFSizes, as_decoders, is_hf_model, logits_width, text_config
from .eagle3 import Eagle3Config, Eagle3Head, choose_draft_vocab
from .prophet import HFProphet, HFProphetConfig
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
    weights_sha256,
)

_LAZY = {"detect_layout": "eagle3_export", "load_eagle3": "eagle3_export", "save_eagle3": "eagle3_export",
         "HFRun": "run", "encode_prompt": "run", "load_hf_run": "run"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [  # HFRun, detect_layout, encode_prompt, load_eagle3, load_hf_run, save_eagle3: loaded on first use
    "Eagle3Config", "Eagle3Head", "HFDecoder", "HFKVCache", "HFOutput", "HFProphet", "HFProphetConfig", "HFRun",
    "HFSizes", "LoadedModel", "as_decoders", "check_same_tokenizer", "check_source", "choose_draft_vocab",
    "detect_layout", "encode_prompt", "head_rows", "is_hf_model", "load_causal_lm", "load_config", "load_eagle3",
    "load_hf_run", "load_model", "load_smollm2", "load_tokenizer", "logits_width", "max_positions", "model_dir",
    "model_dir_fingerprint", "parameter_count", "save_eagle3", "smollm2_gguf", "special_tokens", "target_identity",
    "text_config", "tokenizer_fingerprint", "weights_sha256",
]
