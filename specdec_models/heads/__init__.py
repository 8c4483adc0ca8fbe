"""Every draft-head kind, in one package, behind one interface (`DraftHead`, in `base`): a head
drafts from its target's hidden states, and `generate(target, prompt, n, prophet=head)`, the
evaluation callback and `decode.cost.measure_costs` take any of them.

- `prophet`: `ProphetHead`, the window layout and loss of every prophet head, and
  `ModelWithProphet` (specdec's own decoder with its prophet, trained jointly or frozen), with
  `ProphetLoss`, `drafted_hits` and `simulated_tokens_per_call`;
- `hf_prophet`: `HFProphet`, a prophet head on a frozen Hugging Face target's last-layer hidden states;
- `eagle3`: `Eagle3Head`, an EAGLE-3 head on three of a Hugging Face target's layers, its draft
  vocabulary (`choose_draft_vocab`) and its weight table (`EAGLE3_WEIGHTS`);
- `dflash`: `DFlashHead`, a DFlash head (a block of tokens drafted in one pass by bidirectional
  layers on taps of a Hugging Face target's layers), its training loss (`block_loss`: random
  anchors, position-decayed KL) and its weight table (`dflash_weights`);
- `peagle`: `PEagleHead`, P-EAGLE: an EAGLE-3 head drafting K depths in one pass from mask
  positions, its depth-sampled training (`depth_chains`) and weight table (`PEAGLE_WEIGHTS`);
- `weights`: `WeightTable`, a head kind's weights named once (canonical name, shape, meaning),
  what every export layout renames.

The heads of a Hugging Face target read it through `specdec_models.hf` (the adapter); their export
formats live in `specdec_models.export`. transformers is never imported here.
"""

from .base import DraftHead
from .dflash import DFlashConfig, DFlashHead
from .eagle3 import EAGLE3_WEIGHTS, Eagle3Config, Eagle3Head, choose_draft_vocab
from .hf_prophet import HFProphet, HFProphetConfig
from .peagle import PEAGLE_WEIGHTS, PEagleConfig, PEagleHead
from .prophet import ModelWithProphet, ProphetHead, ProphetLoss, drafted_hits, simulated_tokens_per_call
from .weights import Weight, WeightTable

__all__ = [
    "EAGLE3_WEIGHTS", "PEAGLE_WEIGHTS", "DFlashConfig", "DFlashHead", "DraftHead", "Eagle3Config", "Eagle3Head",
    "HFProphet", "HFProphetConfig", "ModelWithProphet", "PEagleConfig", "PEagleHead", "ProphetHead", "ProphetLoss",
    "Weight", "WeightTable", "choose_draft_vocab", "drafted_hits", "simulated_tokens_per_call",
]
