"""Splitting every sequence over ranks: ``context_parallel`` (keys/values all-gathered over the
``context`` dimension, or passed around it with ``rotation="ring"``: ``ring``; load-balanced
causal chunks) and ATorch's ``sequence_parallel`` (Ulysses: all-to-all between sequence and heads
over the ``sequence`` dimension). ``shard`` says which tokens a rank holds, ``comm`` has the
collectives with autograd, ``attention`` routes a model's attention to them, ``common`` is the
apply both transforms share, ``loss`` the whole sequence's token mean when parts count different
numbers of tokens and the checks that a user's loss trains the split as one process.
"""

from composable_atorch.transforms.parallel.sequence.context import ContextParallel, context_parallel
from composable_atorch.transforms.parallel.sequence.loss import sequence_cross_entropy
from composable_atorch.transforms.parallel.sequence.ulysses import Ulysses, sequence_parallel

__all__ = ["ContextParallel", "Ulysses", "context_parallel", "sequence_cross_entropy", "sequence_parallel"]
