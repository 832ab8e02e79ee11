"""Shared test setup: one thread per process (2 ranks on 2 cores ran 5-10x slower otherwise)."""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

torch.set_num_threads(1)
