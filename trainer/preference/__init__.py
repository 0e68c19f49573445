"""The preference objective (``objective=dpo``): DPO and its variants over packed pairs.

    data (``trainer.data.pairs``: a pair is one example, two sequences)
      -> collate (each sequence its own varlen segment; ``Batch.num_pairs``)
      -> ``logps.sequence_logps``      summed reply log-probs per sequence, through the chunked fused head
      -> ``reference``                 the reference's log-probs: ``live`` (a frozen FSDP2 copy, or the LoRA
                                       base with the adapters off) or ``precompute`` (stored in the cache)
      -> ``objective.pair_losses``     sigmoid / ipo / simpo per pair, and the rewards
      -> ``objective.PreferenceObjective``  what the loop calls: the summed pair loss of a micro-batch (the
                                       loop divides by the GLOBAL pair count) and the TRL-named metrics.

``check.PairLossCheck``: the startup self-check's loss for pairs (the same path, packed vs each sequence alone).
"""

from trainer.preference.check import PairLossCheck
from trainer.preference.logps import sequence_label_counts, sequence_logps
from trainer.preference.objective import (
    PAIR_SUMS, PreferenceObjective, pair_losses, preference_metrics,
)

__all__ = [
    "PAIR_SUMS", "PairLossCheck", "PreferenceObjective", "pair_losses", "preference_metrics", "sequence_label_counts", "sequence_logps",
]
