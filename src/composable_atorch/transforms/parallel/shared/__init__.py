"""What every parallel axis stands on, beside them rather than inside one of them: the parallel
context a step reads (:func:`~.sync.parallel_context`), the roles several families own, gradient
averaging over a group and the broadcast of a module's local tensors (:mod:`.sync`), and the probe
of a model's structure on a zero-weight replica (:mod:`.probe`).

The lowest room of ``transforms/parallel``: data, tensor, pipeline, sequence and expert parallelism
import from here as peers, and this package imports none of them.
"""
