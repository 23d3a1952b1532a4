"""Quality of a model through the real runtime: perplexity and zero-shot accuracy (mlx_flash.eval).

May import the loader (load), the runtime's package API and sparsity; the CLI
is cli/eval.py.
"""

from .harness import (  # noqa: F401
    choice_logliks,
    choice_metrics,
    encode_pair,
    evaluate,
    evaluate_choices,
    evaluate_perplexity,
    load_task,
    perplexity_metrics,
    token_nll,
)
from .tasks import CHOICE_TASKS, PERPLEXITY_TASKS, TASKS, MCItem  # noqa: F401
