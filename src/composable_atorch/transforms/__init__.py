"""One module per family of transforms. Importing this package registers every built transform."""

from . import loop, memory, precision  # noqa: F401
