"""What drafts for `generate`: one object per kind of drafter, each implementing the drafter
protocol (`decode.protocol`: `propose` a chain or a tree, be told what was accepted).

`generate(target, prompt, max_new_tokens, drafter)` decodes plainly without a drafter and
speculatively with one of these:
- `DraftModel(model)`: a smaller decoder (a specdec `Decoder`, an `hf.HFDecoder` or a Hugging
  Face causal LM) drafts a chain of gamma tokens with its own KV cache (method "draft", `decode.chain`);
- `HeadDrafter(head)`: a draft head reading the target's hidden states drafts a chain: a
  `ModelWithProphet` (its `model` is the target) or an `hf.HFProphet` (method "prophet", a
  `ProphetDrafter`), or an `hf.Eagle3Head` (method "eagle3", an `Eagle3Drafter`);
- `BlockDrafter(head, tree=None)`: a head that drafts a block of k tokens in one pass (a
  `heads.dflash.DFlashHead`; `HeadDrafter(head)` builds one too) proposes a chain of up to k, or
  a tree of its top candidates per position (method "dflash", "dflash_tree", `decode.block_draft`);
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
checked by `generate` before any model call (`decode.inputs`, and the drafter's own `check`).
Hugging Face's assisted generation picks its candidate generator from which of `generate()`'s
keywords are set (`assistant_model`, `prompt_lookup_num_tokens`) and vLLM names a method in one
`speculative_config`; here the caller builds the one object, so a drafter cannot be half given or
given twice.
"""

from .block_draft import BlockDrafter
from .chain import DraftModel, Eagle3Drafter, HeadDrafter, ProphetDrafter
from .lookup import Lookup
from .protocol import Draft, Drafter, Plain, Plan, Verdict
from .tree import TreeDrafter

__all__ = ["BlockDrafter", "Draft", "DraftModel", "Drafter", "Eagle3Drafter", "HeadDrafter", "Lookup", "Plain", "Plan",
           "ProphetDrafter", "TreeDrafter", "Verdict"]
