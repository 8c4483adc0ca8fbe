"""specdec's own export format: what decoding loads, written atomically and read without pickle.

An export is a directory holding

    config.json                      {"format": "specdec-export", "format_version": 1,
                                      "kind": "decoder" | "model_with_prophet" | "hf_prophet" | "hf_eagle3"
                                              | "hf_dflash",
                                      "main": ModelConfig dict, "prophet": ProphetConfig dict or null,
                                      "tokenizer": {"kind": "bytes"},
                                      "weights": "weights-<sha256[:16]>.safetensors",
                                      "weights_sha256": "<hex>", "metadata": {...}}
    weights-<sha256[:16]>.safetensors   the model's state_dict; its header's metadata holds
                                     {"specdec_config_sha256": sha256 of the model's config}

A `model_with_prophet` export holds the state_dict of a `ModelWithProphet` (main model, prophet and
the start projection); a `decoder` export a `Decoder`'s. Loading rebuilds the model from the JSON
configs and copies the safetensors tensors in with `load_state_dict`, so nothing is unpickled.

An `hf_prophet` export holds a prophet head for a Hugging Face target (`heads.HFProphet`):
its own trainable weights only ("main": null, "prophet": the HFProphetConfig dict, "tokenizer":
{"kind": "hf_target"}, the target's own), and the identity of the target it was trained for:

    "target": {"path": file or directory it was loaded from (or null), "architecture": class name,
               "hidden_size": int, "vocab_size": int, "weights_sha256": hf.weights_sha256}
    (`hf.target_identity`)

`load_export(DIR, target=model)` attaches the head to `model` (whose embedding and head it
shares) and refuses, in one line, a target whose weights hash differently.

config.json's weights_sha256 covers the weights file, and the weights file covers the model's
config (format, kind, main, prophet, tokenizer, target: `config_sha256`), so an edited
config.json (a larger max_seq_len or prophet_train_length than the model was trained with) is
refused on load in one line naming the file. (Exports written before this key have no such hash
and load as before.)

An `hf_eagle3` export holds an EAGLE-3 head (`heads.Eagle3Head`) the same way: "prophet" is its
Eagle3Config dict, the weights its state_dict under their canonical names (`heads.eagle3.EAGLE3_WEIGHTS`,
the speculators names: `fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d`; the target's embedding
is not saved), "target" its target's identity. The layouts vLLM (speculators) and SGLang load are
written and read by `specdec_models.export.eagle3`. An `hf_dflash` export holds a DFlash head
(`heads.DFlashHead`, its DFlashConfig and its weights under speculators' names, `heads.dflash.dflash_weights`).
An `hf_peagle` export holds a P-EAGLE head (`heads.PEagleHead`: the eagle3 weights and its
`mask_hidden`, `mask_embed`; `heads.peagle.PEAGLE_WEIGHTS`).
The head kinds are the rows of `HEAD_EXPORTS`: another head kind is one more row.

Writing is crash-safe (`specdec_models.files`): the weights go to a new file named after their hash
(written in a temp directory of ours, fsync, rename), then config.json is replaced in one
`os.replace`, the single commit point. A crash at any moment leaves either the old export or the
new one readable; weights files no committed config references and the temps of crashed saves
are deleted by the next successful save. Files get the umask's mode (exports are shared). A save
writes into an existing directory only when it is empty or holds an export of the same model
(`check_export_target`; `force=True` overrides). One writer per directory at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ..config import EXPORT_FORMAT, ModelConfig, ProphetConfig
from ..errors import SpecdecError, check
from ..files import (
    TMP_PREFIX,
    check_writable_dir,
    file_mode,
    fsync_dir,
    os_error,
    remove_stale_temps,
    temp_path,
    write_file,
)
from ..files import one_line as _one_line
from ..heads import (
    DFlashConfig,
    DFlashHead,
    Eagle3Config,
    Eagle3Head,
    HFProphet,
    HFProphetConfig,
    ModelWithProphet,
    PEagleConfig,
    PEagleHead,
)
from ..hf import is_hf_model, target_identity, weights_sha256
from ..model import Decoder
from .checksums import sha256_file

FORMAT = EXPORT_FORMAT
FORMAT_VERSION = 1
CONFIG_NAME = "config.json"
TOKENIZERS = ("bytes",)   # token id = byte value of the UTF-8 text
HF_TARGET_TOKENIZER = {"kind": "hf_target"}   # an hf_prophet head uses its target's own tokenizer
Head = HFProphet | Eagle3Head | DFlashHead


class HeadExport(NamedTuple):
    """A head kind specdec's format holds: its class, what it is called in errors, and how it is
    rebuilt from its config dict ("prophet") and its target, weights still to load."""

    head: type
    what: str
    rebuild: Callable[[dict[str, Any], Any], Head]


# the heads for a Hugging Face target, by kind (no model of their own): a new head kind is one row
HEAD_EXPORTS = {
    "hf_prophet": HeadExport(HFProphet, "a prophet head",
                             lambda c, target: HFProphet(HFProphetConfig.from_dict(c), target)),
    "hf_eagle3": HeadExport(Eagle3Head, "an eagle3 head",
                            lambda c, target: Eagle3Head(Eagle3Config.from_dict(c), target, init_from_target=False)),
    "hf_peagle": HeadExport(PEagleHead, "a peagle head",
                            lambda c, target: PEagleHead(PEagleConfig.from_dict(c), target, init_from_target=False)),
    "hf_dflash": HeadExport(DFlashHead, "a dflash head",
                            lambda c, target: DFlashHead(DFlashConfig.from_dict(c), target, init_from_target=False)),
}
HEAD_KINDS = tuple(HEAD_EXPORTS)
HEAD_TYPES = tuple(entry.head for entry in HEAD_EXPORTS.values())
KINDS = ("decoder", "model_with_prophet", *HEAD_KINDS)
FORCE = "force=True, specdec export --force"
CONFIG_HASH_KEY = "specdec_config_sha256"       # in the weights file's safetensors metadata
HEADER_KEYS = ("format", "format_version", "kind", "main", "prophet", "tokenizer", "target")


def config_sha256(config: dict[str, Any]) -> str:
    """The sha256 of what identifies an export's model in its config.json (HEADER_KEYS: not the
    weights' name and hash, not the run metadata), as canonical JSON."""
    header = {key: config[key] for key in HEADER_KEYS if key in config}
    return hashlib.sha256(json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- writing

def save_export(directory: str | os.PathLike, model: Decoder | ModelWithProphet | Head, *,
                tokenizer: str | dict[str, Any] | None = None, metadata: dict[str, Any] | None = None,
                target_path: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Write `model` as an export into `directory` (created if needed) and return its path.

    Replaces a previous export of the same model (kind, configs, tokenizer) in the same directory
    atomically; refuses (`SpecdecError`) a folder that is not an export and an export of another
    model unless `force` (see `check_export_target`). `metadata` must be plain JSON values (run
    name, training step, ...). tokenizer: "bytes" (the default) for a Decoder or a
    ModelWithProphet; a head (HFProphet, Eagle3Head) uses its target's. target_path: where a
    head's target was loaded from (default: the target's `name_or_path`), recorded with its
    weights' hash."""
    directory = Path(directory)
    header = _header(model, tokenizer, target_path)
    metadata = {} if metadata is None else metadata
    check(isinstance(metadata, dict), f"export metadata must be a dict, got {type(metadata).__name__}")
    try:
        json.dumps(metadata, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise SpecdecError(f"export metadata must hold plain JSON values: {_one_line(error)}") from None
    _check_target(directory, header, force)
    check_writable_dir(directory, "export directory")

    # Decoder stores some weights column-major; safetensors wants contiguous tensors. The layout
    # comes back on load, because load_state_dict copies into the freshly built model's strides.
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # safetensors writes through a temp file of its own (".tmpXXXXXX", mode 0600): it goes
        # into a temp directory of ours, which a crashed save leaves for the next save to remove
        staging = temp_path(directory / "weights")
        staging.mkdir()
        try:
            written = staging / "weights.safetensors"
            save_file(tensors, str(written), metadata={CONFIG_HASH_KEY: config_sha256(header)})
            with open(written, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(written, file_mode())
            digest = sha256_file(written)
            weights_name = f"weights-{digest[:16]}.safetensors"
            os.replace(written, directory / weights_name)   # same bytes if it already exists
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        fsync_dir(directory)
        config = {**header, "weights": weights_name, "weights_sha256": digest, "metadata": metadata}
        text = json.dumps(config, indent=2, sort_keys=True, allow_nan=False) + "\n"
        write_file(directory / CONFIG_NAME, lambda f: f.write(text.encode("utf-8")))   # the commit point
        _remove_unreferenced(directory, keep=weights_name)
    except OSError as error:
        raise os_error(error, f"cannot write the export to {directory}") from None
    return directory


def _header(model: Decoder | ModelWithProphet | Head, tokenizer: str | dict[str, Any] | None,
            target_path: str | os.PathLike | None = None) -> dict[str, Any]:
    """What identifies an export's model: format, kind, configs, tokenizer and, for a head, its
    target (config.json without the weights and metadata)."""
    if isinstance(model, HEAD_TYPES):
        # the most specific kind: a PEagleHead is an Eagle3Head too
        kind = next((k for k, entry in HEAD_EXPORTS.items() if type(model) is entry.head), None) \
            or next(k for k, entry in HEAD_EXPORTS.items() if isinstance(model, entry.head))
        check(tokenizer is None, f"an {kind} export uses its target's tokenizer: pass no tokenizer")
        fields = {"kind": kind, "main": None, "prophet": model.config.to_dict(),
                  "tokenizer": dict(HF_TARGET_TOKENIZER), "target": target_identity(model.target, target_path)}
    elif isinstance(model, (ModelWithProphet, Decoder)):
        check(target_path is None, "target_path is only for the export of a head for a Hugging Face target")
        with_prophet = isinstance(model, ModelWithProphet)
        fields = {"kind": "model_with_prophet" if with_prophet else "decoder",
                  "main": (model.main_cfg if with_prophet else model.cfg).to_dict(),
                  "prophet": model.prophet_cfg.to_dict() if with_prophet else None,
                  "tokenizer": _tokenizer_dict("bytes" if tokenizer is None else tokenizer)}
    else:
        raise SpecdecError(f"can only export a Decoder or a ModelWithProphet (or an HFProphet or an Eagle3Head), "
                           f"got {type(model).__name__}")
    return {"format": FORMAT, "format_version": FORMAT_VERSION, **fields}


def _tokenizer_dict(tokenizer: str | dict[str, Any]) -> dict[str, Any]:
    spec = {"kind": tokenizer} if isinstance(tokenizer, str) else tokenizer
    check(isinstance(spec, dict) and spec.get("kind") in TOKENIZERS and set(spec) == {"kind"},
          f"tokenizer must be one of {', '.join(TOKENIZERS)} (or {{'kind': ...}}), got {tokenizer!r}")
    return dict(spec)


def check_export_target(directory: str | os.PathLike, model: Decoder | ModelWithProphet | Head, *,
                        tokenizer: str | dict[str, Any] | None = None, target_path: str | os.PathLike | None = None,
                        force: bool = False) -> dict[str, Any] | None:
    """May `save_export(directory, model, tokenizer=..., target_path=...)` write there? Raises a
    one-line `SpecdecError` when `directory` is a file, a non-empty folder that is not a specdec
    export (an embeddings cache, a Hugging Face model), or an export of another model (kind,
    configs, tokenizer or a head's target differ); `force` allows the last two. Returns the
    config.json of the export it would replace, or None."""
    return _check_target(Path(directory), _header(model, tokenizer, target_path), force)


def _check_target(directory: Path, header: dict[str, Any], force: bool) -> dict[str, Any] | None:
    check(not directory.exists() or directory.is_dir(), f"export path {directory} exists and is not a directory")
    if not directory.is_dir():
        return None
    path = directory / CONFIG_NAME
    try:
        existing = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except (OSError, UnicodeDecodeError, ValueError):
        existing = None
    if not (isinstance(existing, dict) and existing.get("format") == FORMAT):
        others = sorted(p.name for p in directory.iterdir() if not p.name.startswith(TMP_PREFIX))
        check(force or not others, f"{directory} is not a specdec export (it holds {_few(others, 3)}): choose an "
                                   f"empty or new export directory, or write into it on purpose ({FORCE})")
        return None
    changed = sorted(key for key in header if existing.get(key) != header[key])
    check(force or not changed, f"{directory} holds {describe_export(existing)}, another model (its "
                                f"{', '.join(changed)} differ): choose another export directory, or replace it on "
                                f"purpose ({FORCE})")
    return existing


def describe_export(config: dict[str, Any]) -> str:
    """One line naming an export from its config.json: kind, training step, weights hash."""
    step = (config.get("metadata") or {}).get("global_step")
    sha = str(config.get("weights_sha256") or "?")[:16]
    return f"a {config.get('kind')} export" + (f" of step {step}" if step is not None else "") + f" (weights {sha})"


def _remove_unreferenced(directory: Path, keep: str) -> None:
    """Delete weights files no committed config references, and temps of crashed saves."""
    for path in directory.iterdir():
        if path.name.startswith("weights-") and path.name.endswith(".safetensors") and path.name != keep:
            path.unlink(missing_ok=True)
    remove_stale_temps(directory)


# ---------------------------------------------------------------- reading

def read_json_object(path: Path, remedy: str) -> dict[str, Any]:
    """The JSON object in `path`; a file that is not valid JSON or not an object raises
    `SpecdecError` ending with `remedy` (what the user should do)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise SpecdecError(f"{path} is not valid JSON ({_one_line(error)}): {remedy}") from None
    check(isinstance(data, dict), f"{path} must hold a JSON object: {remedy}")
    return data


def read_export_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The validated config.json of an export (configs still as dicts). Raises `SpecdecError`
    with what to do when the directory is not a readable export of this format version."""
    directory = Path(directory)
    check(directory.is_dir(), f"export directory {directory} does not exist: pass a directory written by "
                              f"save_export (specdec train or specdec export)")
    path = directory / CONFIG_NAME
    check(path.is_file(), f"{path} is missing: {directory} is not a specdec export (write one with specdec export)")
    config = read_json_object(path, "re-export the model")
    check(config.get("format") == FORMAT,
          f"{path} has format {config.get('format')!r}, expected {FORMAT!r}: not a specdec export")
    version = config.get("format_version")
    check(version == FORMAT_VERSION,
          f"{path} has format_version {version!r}, this specdec reads version {FORMAT_VERSION}: "
          f"re-export the model with this version (or use the specdec that wrote it)")
    kind = config.get("kind")
    check(kind in KINDS, f"{path} has kind {kind!r}, expected one of {', '.join(KINDS)}: re-export the model")
    check((config.get("prophet") is None) == (kind == "decoder"),
          f"{path}: a {kind} export must {'not ' if kind == 'decoder' else ''}have a prophet config: "
          f"re-export the model")
    tokenizer = config.get("tokenizer")
    if kind in HEAD_KINDS:
        check(tokenizer == HF_TARGET_TOKENIZER, f"{path} has tokenizer {tokenizer!r}; an {kind} export uses "
                                                f"its target's ({HF_TARGET_TOKENIZER}): re-export the head")
        target = config.get("target")
        check(isinstance(target, dict) and isinstance(target.get("weights_sha256"), str)
              and len(target["weights_sha256"]) == 64 and isinstance(target.get("path"), (str, type(None))),
              f"{path}: an {kind} export needs 'target' with the target's 'path' and 'weights_sha256': "
              f"re-export the head")
    else:
        check(isinstance(tokenizer, dict) and tokenizer.get("kind") in TOKENIZERS,
              f"{path} has tokenizer {tokenizer!r}; this specdec knows {', '.join(TOKENIZERS)}")
    weights = config.get("weights")
    check(isinstance(weights, str) and weights and Path(weights).name == weights and weights not in (".", ".."),
          f"{path}: 'weights' must be a file name inside the export directory, got {weights!r}")
    sha = config.get("weights_sha256")
    check(isinstance(sha, str) and len(sha) == 64,
          f"{path}: 'weights_sha256' is missing or malformed: re-export the model")
    check(isinstance(config.get("metadata", {}), dict), f"{path}: 'metadata' must be a JSON object")
    return config


def read_main_config(directory: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    """(the ModelConfig of a specdec decoder export's model, or of a model_with_prophet export's
    main model; the whole config.json): what a frozen teacher or main model is built from. An
    hf_prophet or hf_eagle3 export (a head without a model of its own) is refused in one line."""
    config = read_export_config(directory)
    check(config["kind"] not in HEAD_KINDS,
          f"{directory} is an {config['kind']} export (a draft head for a Hugging Face target), not a specdec model: "
          f"give a decoder or model_with_prophet export")
    try:
        return ModelConfig.from_dict(config["main"]), config
    except (SpecdecError, TypeError) as error:
        raise SpecdecError(f"{directory}: bad main model config ({_one_line(error)}): re-export the model") from None


def export_hash(directory: str | os.PathLike, *, verify: bool = False) -> str:
    """The sha256 (hex) of the export's weights file, as recorded in config.json: an identity of
    the model's weights, e.g. to check a cache was made by the same model. `verify=True` also
    re-hashes the file and raises `SpecdecError` if it no longer matches."""
    directory = Path(directory)
    config = read_export_config(directory)
    if verify:
        _check_weights_file(directory, config)
    return config["weights_sha256"]


def load_export(directory: str | os.PathLike, *, map_location: str | torch.device = "cpu",
                target: Any = None) -> Decoder | ModelWithProphet | Head:
    """Rebuild the model of an export (in eval mode, on `map_location`): a `Decoder` or a
    `ModelWithProphet`, by the export's kind. Uses no pickle: JSON configs and safetensors only.

    An hf_prophet or hf_eagle3 export needs `target`, the Hugging Face model it was trained for
    (checked by the hash of its weights); the head (an `HFProphet` or an `Eagle3Head`) lives on the
    target's device and shares its embedding (and an HFProphet its head)."""
    directory = Path(directory)
    config = read_export_config(directory)
    path = directory / CONFIG_NAME
    if config["kind"] in HEAD_KINDS:
        model = _head(directory, config, target)
    else:
        check(target is None, f"{directory} holds a {config['kind']} export: target= is only for an hf_prophet or "
                              f"hf_eagle3 export (a head for a Hugging Face target)")
        try:
            main = ModelConfig.from_dict(config.get("main"))
            prophet = None if config["prophet"] is None else ProphetConfig.from_dict(config["prophet"])
            model = Decoder(main) if prophet is None else ModelWithProphet(main, prophet)
        except (SpecdecError, TypeError) as error:
            raise SpecdecError(f"{path}: bad model config ({_one_line(error)}): re-export the model") from None

    tensors = read_export_tensors(directory, config)
    weights = directory / config["weights"]
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    check(not missing and not unexpected,
          f"{weights} does not match the {config['kind']} config in {path}: "
          f"missing tensors {_few(missing)}, unexpected tensors {_few(unexpected)}; re-export the model")
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1 and not isinstance(model, HEAD_TYPES):
        model.to(dtypes.pop())    # keep the precision the model was exported in (a head takes its target's)
    try:
        # copies into the existing parameters, so Decoder's column-major layout survives
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as error:
        raise SpecdecError(f"{weights} does not match the config in {path} ({_one_line(error)}): "
                           f"re-export the model") from None
    return (model if isinstance(model, HEAD_TYPES) else model.to(map_location)).eval()


def read_export_tensors(directory: str | os.PathLike, config: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """The weights of an export as saved (name -> CPU tensor, in the export's dtype), after checking
    the file's hash and that it belongs to config.json (`config`: that file, already read): what
    `load_export` loads, and what a training run that starts from an export copies in full precision."""
    directory = Path(directory)
    config = read_export_config(directory) if config is None else config
    weights = _check_weights_file(directory, config)
    try:
        return load_file(str(weights), device="cpu")
    except Exception as error:  # noqa: BLE001  safetensors raises its own error types for a corrupt file
        raise SpecdecError(f"cannot read weights file {weights} ({_one_line(error)}): re-export the model") from None


def _head(directory: Path, config: dict[str, Any], target: Any) -> Head:
    """The head of a head kind (`HEAD_EXPORTS`) for `target`, weights still to load; refuses a target
    other than the recorded one."""
    kind = config["kind"]
    what = HEAD_EXPORTS[kind].what
    recorded = config["target"]
    trained_for = f"{recorded.get('architecture', 'a model')} from {recorded.get('path') or 'an unrecorded path'}"
    check(target is not None, f"{directory} holds {what} for a Hugging Face target ({trained_for}): "
                              f"load it with load_export(DIR, target=<that model>)")
    check(is_hf_model(target), f"the target of the head in {directory} must be a Hugging Face causal LM, "
                               f"got {type(target).__name__}")
    found = weights_sha256(target)
    check(found == recorded["weights_sha256"],
          f"{what} in {directory} was trained for another target ({trained_for}, weights sha256 "
          f"{recorded['weights_sha256'][:16]}...); the given {type(target).__name__}'s weights hash to "
          f"{found[:16]}...: load the target it was trained for")
    try:
        return HEAD_EXPORTS[kind].rebuild(config["prophet"], target)
    except (SpecdecError, TypeError) as error:
        raise SpecdecError(f"{directory / CONFIG_NAME}: bad {kind} config ({_one_line(error)}): "
                           f"re-export the head") from None


def _check_weights_file(directory: Path, config: dict[str, Any]) -> Path:
    weights = directory / config["weights"]
    check(weights.is_file(), f"weights file {weights} named in {directory / CONFIG_NAME} is missing: "
                             f"the export is incomplete, re-export the model")
    digest = sha256_file(weights)
    check(digest == config["weights_sha256"],
          f"weights file {weights} has sha256 {digest[:16]}..., config.json records "
          f"{config['weights_sha256'][:16]}...: the file is truncated or corrupt, re-export the model")
    try:
        with safe_open(str(weights), framework="pt") as f:
            recorded = (f.metadata() or {}).get(CONFIG_HASH_KEY)
    except Exception as error:  # noqa: BLE001  safetensors raises its own error types for a corrupt file
        raise SpecdecError(f"cannot read weights file {weights} ({_one_line(error)}): re-export the model") from None
    check(recorded is None or recorded == config_sha256(config),
          f"{weights} does not match the {config['kind']} config in {directory / CONFIG_NAME}: that config "
          f"(kind, main, prophet, tokenizer) is not the one these weights were exported with (was config.json "
          f"edited?): restore it or re-export the model")
    return weights


def _few(names: list[str], limit: int = 4) -> str:
    if not names:
        return "none"
    shown = ", ".join(names[:limit])
    return shown + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


