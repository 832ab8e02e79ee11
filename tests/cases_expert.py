"""Registry-matrix case for expert_parallel (world 2): a plain user MoE model whose experts module
follows the experts protocol, trained on the matrix's text batches. Each rank holds half of the
experts under the same names, so the parameter count per rank falls (names are kept)."""

from composable_atorch import expert_parallel, parallel_mode

from matrix import Case


def _byte_vocab():
    """The user MoE model over the matrix loader's byte vocabulary."""
    from zoo import moe

    return moe.build("user", vocab=256)


CASES = {
    "expert_parallel": Case(
        lambda: expert_parallel(),
        world=2,
        extra=lambda: (parallel_mode([("expert", 2), ("data", 1)]),),
        model=_byte_vocab,
        names_kept=False,
    ),
}
