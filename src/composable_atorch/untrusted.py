"""Reading bytes that came from elsewhere (a plan file, a ``ds_config``, a checkpoint's JSON).

A file named by a plan or found in a checkpoint directory is data someone else may have written.
It is opened only if it is a regular file (a FIFO would block the reader forever, a device could
stream without end), read only up to a size bound, and parsed as JSON only below a nesting bound
(Python's JSON parser recurses: a deeply nested document raises RecursionError, which is not a
user-facing error). Every refusal is an :class:`~composable_atorch.errors.UntrustedInputError`
naming the field and the fix.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any

from composable_atorch.errors import UntrustedInputError

#: plans and DeepSpeed configs are a few kilobytes; the bound only stops a file meant to exhaust memory
MAX_JSON_BYTES = 16 * 1024 * 1024
#: saved plans nest about 8 levels (tensor-parallel plans the most); 64 leaves room and stays far
#: below the interpreter's recursion limit
MAX_DEPTH = 64

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def require_regular_file(path: str | os.PathLike, field: str) -> None:
    """``path`` exists and is a regular file, checked by ``os.stat`` alone (nothing is opened, so a
    FIFO cannot block the check)."""
    try:
        kind = os.stat(path).st_mode
    except OSError as exc:
        raise UntrustedInputError(field, str(path), f"an existing, readable regular file ({exc.strerror})") from None
    if not stat.S_ISREG(kind):
        raise UntrustedInputError(field, str(path), "a regular file (not a FIFO, device, socket or directory)")


def read_regular_file(path: str | os.PathLike, field: str, *, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes.

    The kind is checked twice: ``os.stat`` before opening (a clear error for a FIFO or device),
    then ``fstat`` on the descriptor, opened non-blocking, so a file swapped for a FIFO between
    the two checks cannot block either.
    """
    require_regular_file(path, field)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise UntrustedInputError(field, str(path), f"a readable regular file ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedInputError(field, str(path), "a regular file (not a FIFO, device, socket or directory)")
        if info.st_size > limit:
            raise UntrustedInputError(field, str(path), f"a file of at most {limit} bytes (it has {info.st_size})")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise UntrustedInputError(field, str(path), f"a file of at most {limit} bytes (it grew while read)")
    return b"".join(chunks)


def json_depth(text: str) -> int:
    """How deep ``text``'s arrays and objects nest, brackets inside strings not counted (no recursion)."""
    depth = deepest = 0
    for ch in _NOT_BRACKETS.sub("", _STRINGS.sub("", text)):
        depth += 1 if ch in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def loads(text: str, field: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """``json.loads(text)`` below the nesting bound; UntrustedInputError above it.

    A JSON syntax error is left to the caller (json.JSONDecodeError), who knows what to call it.
    """
    if json_depth(text) > max_depth:
        raise UntrustedInputError(
            field, f"JSON nested deeper than {max_depth} levels", f"a document nesting at most {max_depth} levels"
        )
    try:
        return json.loads(text)
    except RecursionError:  # the scan above should have caught it; never let it escape untyped
        raise UntrustedInputError(field, "JSON nested too deeply", f"at most {max_depth} levels") from None


def check_depth(value: Any, field: str, *, max_depth: int = MAX_DEPTH) -> None:
    """The same bound for values already decoded (a dict handed to ``Plan.from_dict``), iteratively."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth > max_depth:
                raise UntrustedInputError(
                    field, f"a value nested deeper than {max_depth} levels", f"at most {max_depth} levels"
                )
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
