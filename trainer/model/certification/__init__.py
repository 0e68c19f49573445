"""One certification: does a packed row train exactly what its examples train one by one, for this model?

Three stages answer it, each vouching where the earlier cannot, and give one verdict (``Certificate``), one
line at start (``certified exact: FAMILY (table prior: ...; replica: ...; self-check: ...)``) and one record
in the run's ``summary.json`` (``certification``), or one refusal line naming the stage and the setting:

1. the **table prior** (``trainer.model.families``): every causal-LM family of transformers probed on its
   default config (``benchmarks/family_matrix.py``, the replica stage run on each): exact, refused, or
   untested (newer than the table: the next stages decide; with ``model.self_check=false``, refused);
2. the **replica** (``replica``): a tiny float64 replica of the user's config (``shrink``), packed vs one
   by one, cached (``cache``), before any weight is loaded; no replica that runs: the self-check decides;
3. the **self-check** (``stages.check_model``): the run's real model and a worst-case batch of its own data
   (``stages.worst_case_microbatch``), through the run's route and the objective's loss of the check.

The replica and the self-check are one comparison (``engine.measure``): one packed-vs-alone runner, one
tolerance per dtype, one NaN rule, one result type (``engine.Measurement``). ``build_model`` runs stages 1-2
(``certify_config``), the trainer stage 3 (``certify``), which logs the line.
"""

from trainer.model.certification.certificate import Certificate, Stage, refusal_line
from trainer.model.certification.engine import Measurement, TokenLossCheck, measure, packed_batch
from trainer.model.certification.stages import certify, certify_config, check_model, worst_case_microbatch

__all__ = [
    "Certificate",
    "Measurement",
    "Stage",
    "TokenLossCheck",
    "certify",
    "certify_config",
    "check_model",
    "measure",
    "packed_batch",
    "refusal_line",
    "worst_case_microbatch",
]
