"""What drafts for `generate`: one object per kind of drafter.

`generate(target, prompt, max_new_tokens, drafter)` decodes plainly without a drafter and
speculatively with one of these, and picks the decoding from the drafter's type:
- `DraftModel(model)`: a smaller decoder (a specdec `Decoder`, an `hf.HFDecoder` or a Hugging
  Face causal LM) drafts a chain of gamma tokens with its own KV cache (method "draft");
- `HeadDrafter(head)`: a draft head reading the target's hidden states drafts a chain: a
  `ModelWithProphet` (its `model` is the target) or an `hf.HFProphet` (method "prophet"), or an
  `hf.Eagle3Head` (method "eagle3");
- `TreeDrafter(head, tree, datastore=None)`: an `hf.Eagle3Head` drafts a tree of candidates shaped
  by `tree` (a `decode.tree.TreeSpec`, whose `lookup` adds a prompt-lookup path), verified in one
  call per row (method "eagle3_tree"); a `decode.datastore.Datastore` of the target's own answers
  proposes that looked-up path where it matches a longer n-gram than the context does;
- `Lookup(lookup, lookup_max=0, datastore=None)`: no model drafts; prompt lookup (Saxena 2023)
  proposes the tokens that followed the context's last n-gram earlier in it (or a datastore's
  continuation of a longer one), verified in one call per row (method "lookup", `decode.lookup`):
  a tree of only its looked-up path, for a specdec `Decoder` or a Hugging Face target.

Each drafter checks its own arguments when it is built (one-line `SpecdecError`s); what depends
on the target (its vocabulary, whether a head was built for it, a prophet's trained length) is
checked by `generate` before any model call (`decode.inputs`). Hugging Face's assisted generation
picks its candidate generator from which of `generate()`'s keywords are set (`assistant_model`,
`prompt_lookup_num_tokens`) and vLLM names a method in one `speculative_config`; here the caller
builds the one object, so a drafter cannot be half given or given twice.
"""

from __future__ import annotations

from torch import nn

from ..errors import check
from ..heads import DraftHead, Eagle3Head
from ..hf import HFDecoder, is_hf_model
from ..model import Decoder
from .datastore import Datastore
from .tree import TreeSpec


class Drafter:
    """The base class of the drafters (module docstring). `method` names the decoding (as
    `DecodeStats.method` reports it); `model` is a draft model, `head` a draft head, `tree` and
    `datastore` a tree's shape and its looked-up path's store; a drafter sets the ones it uses."""

    method = ""
    model: Decoder | HFDecoder | nn.Module | None = None
    head: DraftHead | None = None
    tree: TreeSpec | None = None
    datastore: Datastore | None = None

    @property
    def module(self) -> nn.Module | None:
        """The module that drafts (the draft model or the head): what a caller moves to a device,
        puts in eval mode or prepares for a dtype alongside the target; None for `Lookup`."""
        return self.model if self.model is not None else self.head

    def __repr__(self) -> str:
        parts = ([type(self.module).__name__] if self.module is not None else []) + ([repr(self.tree)] if self.tree is not None else []) \
            + (["Datastore"] if self.datastore is not None else [])
        return f"{type(self).__name__}({', '.join(parts)})"


class DraftModel(Drafter):
    """A draft model: a specdec `Decoder`, an `hf.HFDecoder` or a Hugging Face causal LM (wrapped
    by `generate`, whose `vocab_size` slices its logits to the target's vocabulary)."""

    method = "draft"

    def __init__(self, model: Decoder | HFDecoder | nn.Module) -> None:
        check(isinstance(model, (Decoder, HFDecoder)) or is_hf_model(model),
              f"DraftModel drafts with a specdec_models Decoder or a Hugging Face causal LM, "
              f"got {type(model).__name__}")
        self.model = model


class HeadDrafter(Drafter):
    """A draft head drafting a chain from the target's hidden states: a `ModelWithProphet` or an
    `hf.HFProphet` (method "prophet"), or an `hf.Eagle3Head` (method "eagle3")."""

    def __init__(self, head: DraftHead) -> None:
        check(isinstance(head, DraftHead), f"HeadDrafter drafts with a draft head (a ModelWithProphet, an HFProphet "
                                           f"or an Eagle3Head), got {type(head).__name__}")
        self.head = head

    @property
    def method(self) -> str:
        return "eagle3" if isinstance(self.head, Eagle3Head) else "prophet"


class TreeDrafter(Drafter):
    """An EAGLE-3 head drafting a tree shaped by `tree` (`decode.tree`); `datastore` (with a tree
    whose lookup is on) proposes the looked-up path where it matches a longer n-gram than the
    context does (`decode.datastore`)."""

    method = "eagle3_tree"

    def __init__(self, head: Eagle3Head, tree: TreeSpec, datastore: Datastore | None = None) -> None:
        check(datastore is None or (isinstance(tree, TreeSpec) and tree.lookup > 0),
              "a datastore proposes a tree's looked-up path: pass it with a tree whose lookup is on (e.g. 8,4,3,4..16)")
        check(datastore is None or isinstance(datastore, Datastore),
              f"datastore must be a decode.datastore.Datastore, got {type(datastore).__name__}")
        check(isinstance(tree, TreeSpec), f"tree must be a decode.tree.TreeSpec, got {type(tree).__name__}")
        check(isinstance(head, Eagle3Head), f"tree drafting needs an EAGLE-3 head (an hf.Eagle3Head), "
                                            f"got {type(head).__name__}")
        self.head, self.tree, self.datastore = head, tree, datastore


class Lookup(Drafter):
    """Prompt-lookup decoding (`decode.lookup`): `lookup` tokens looked up in the row's context per
    round (or in `datastore`, where it matches a longer n-gram); `lookup_max` > 0 makes the length
    adaptive, from `lookup` up to `lookup_max` (doubled after a round that accepted all of it, back
    to `lookup` after a miss), as `TreeSpec`'s fields of the same names. `tree` is the lookup's
    `TreeSpec` (its head fields unused)."""

    method = "lookup"

    def __init__(self, lookup: int, lookup_max: int = 0, datastore: Datastore | None = None) -> None:
        check(isinstance(lookup, int) and not isinstance(lookup, bool) and lookup >= 1,
              f"lookup must be an integer >= 1 (the tokens looked up per round), got {lookup!r}")
        check(isinstance(lookup_max, int) and not isinstance(lookup_max, bool)
              and (lookup_max == 0 or lookup_max >= lookup),
              f"lookup_max must be 0 (a fixed length) or an integer >= lookup ({lookup}), got {lookup_max!r}")
        check(datastore is None or isinstance(datastore, Datastore),
              f"datastore must be a decode.datastore.Datastore, got {type(datastore).__name__}")
        self.tree = TreeSpec(1, 1, 1, lookup=lookup, lookup_max=lookup_max)
        self.datastore = datastore

    def __repr__(self) -> str:
        spec = self.tree
        length = f"{spec.lookup}..{spec.lookup_max}" if spec.adaptive else f"{spec.lookup}"
        return f"Lookup({length}{', Datastore' if self.datastore is not None else ''})"
