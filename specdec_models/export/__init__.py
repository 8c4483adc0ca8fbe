"""Every export format, in one package: what training writes and decoding (or another server) loads.

- `specdec`: specdec's own format (`save_export` / `load_export`: config.json with a format
  version and safetensors weights named after their hash; kinds `decoder`, `model_with_prophet`,
  and the heads `hf_prophet`, `hf_eagle3` and `hf_dflash` for a Hugging Face target);
- `layouts`: a serving layout as data (`Layout`: a `NameMap` from a head's canonical weight names
  to the layout's, a `TapNumbering`, its config writer and reader), a head kind's layouts
  (`HeadKind`), and the one writer and reader that apply them to any head kind (`save_head`,
  `load_head`, `detect`; `rename` applies a name map either way);
- `checksums`: SHA256SUMS, the weights' checksum file the foreign layouts carry and their loader
  verifies when present (`write_checksums`, `check_checksums`);
- `eagle3`: an EAGLE-3 head in specdec's, vLLM's (speculators) and SGLang's layouts
  (`save_eagle3` / `load_eagle3` / `detect_layout`; the layouts `EAGLE3_LAYOUTS`);
- `dflash`: a DFlash head in specdec's and speculators' layouts (`save_dflash` / `load_dflash`;
  SGLang reads z-lab's own layout, which is not written);
- `heads`: any head kind's export told apart by what it holds (`HEADS`, one row per head kind;
  `detect_head`, `load_any_head`), what the evaluation loads a `--head` with;
- `peagle`: a P-EAGLE head in specdec's and speculators' layouts (`save_peagle` / `load_peagle`;
  speculators' mask_hidden (1, 1, A*H) and the target's embedding table with the mask row replaced);
- `hf_draft`: a draft causal LM as a Hugging Face model directory for transformers' assisted
  generation and vLLM (`save_hf_draft`, `check_hf_draft_dir`; task=hf_draft_distill's export);
- `load`: a Hugging Face target with a draft or a head loaded and checked for decoding
  (`load_hf_run`, `HFRun`; `encode_prompt`), what the decoding CLI and `specdec export-head` call.

Every writer is atomic: a crash leaves the previous export readable (see each module).
"""

from .checksums import CHECKSUMS_NAME, check_checksums, sha256_file, write_checksums
from .dflash import DFLASH, load_dflash, save_dflash
from .eagle3 import EAGLE3, EAGLE3_LAYOUTS, LAYOUTS, SPECULATIVE_TOKENS, detect_layout, load_eagle3, save_eagle3
from .heads import HEADS, FoundHead, detect_head, load_any_head
from .hf_draft import (
    HF_DRAFT_METADATA,
    assistant_generation_config,
    check_hf_draft_dir,
    sampling_temperature,
    save_hf_draft,
)
from .layouts import HeadKind, Layout, NameMap, Rename, TapNumbering, load_head, rename, save_head
from .load import HFRun, encode_prompt, load_hf_run
from .specdec import (
    CONFIG_NAME,
    FORMAT,
    FORMAT_VERSION,
    HEAD_KINDS,
    KINDS,
    check_export_target,
    config_sha256,
    describe_export,
    export_hash,
    load_export,
    read_export_config,
    read_export_tensors,
    read_json_object,
    read_main_config,
    save_export,
)

__all__ = [
    "CHECKSUMS_NAME", "CONFIG_NAME", "DFLASH", "EAGLE3", "EAGLE3_LAYOUTS", "FORMAT", "FORMAT_VERSION", "FoundHead",
    "HEADS", "HEAD_KINDS", "HFRun", "HF_DRAFT_METADATA", "HeadKind", "KINDS", "LAYOUTS", "Layout", "NameMap", "Rename",
    "SPECULATIVE_TOKENS", "TapNumbering", "assistant_generation_config", "check_checksums", "check_export_target",
    "check_hf_draft_dir", "config_sha256", "describe_export", "detect_head", "detect_layout", "encode_prompt",
    "export_hash", "load_eagle3", "load_export", "load_any_head", "load_dflash", "load_head", "load_hf_run",
    "read_export_config", "read_export_tensors", "read_json_object", "read_main_config", "rename",
    "sampling_temperature", "save_dflash", "save_eagle3", "save_export", "save_head", "save_hf_draft", "sha256_file",
    "write_checksums",
]
