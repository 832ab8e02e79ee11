"""Registry-matrix cases for splitting sequences over ranks (world 2): context_parallel and ATorch's
sequence_parallel (Ulysses), on a plain user model calling scaled_dot_product_attention with a
``position_ids`` argument (the built-in GPT writes its attention out, which a split cannot reach)."""

from _seq import user_lm
from composable_atorch import context_parallel, parallel_mode, sequence_parallel

from matrix import Case

CASES = {
    "context_parallel": Case(
        lambda: context_parallel(), world=2, extra=lambda: (parallel_mode([("context", 2)]),), model=user_lm
    ),
    "sequence_parallel": Case(
        lambda: sequence_parallel(), world=2, extra=lambda: (parallel_mode([("sequence", 2)]),), model=user_lm
    ),
}
