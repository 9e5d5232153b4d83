"""Bounded JSON: every document from outside is parsed here, with its size and nesting depth limited.

The stdlib's ``json`` recurses once per nesting level and raises ``RecursionError`` (not ``ValueError``)
on a few thousand ``[``: on a network thread that is an exception nobody expects. This module reads
bytes with pydantic-core's parser, which refuses more than ~200 levels with a ``ValueError`` of its own,
then holds the document to :data:`MAX_DEPTH` levels (an iterative walk, no recursion), so a caller gets
either data no deeper than it can handle or a :class:`~protocol.errors.SchemaError` naming the source.
"""

from __future__ import annotations

from typing import Any

import pydantic_core

from .errors import SchemaError

__all__ = ["MAX_DEPTH", "check_depth", "loads"]

MAX_DEPTH = 32  # nesting levels of arrays and objects; no edgefleet document needs more than 8


def check_depth(data: Any, max_depth: int = MAX_DEPTH) -> int | None:
    """The depth at which ``data`` goes past ``max_depth`` levels, or None if it stays within them."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > max_depth:
            return depth
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return None


def loads(raw: bytes | str, *, source: str, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """Parse ``raw`` (UTF-8 JSON) of at most ``max_bytes`` bytes and ``max_depth`` nesting levels.

    Raises SchemaError (a ContractError) for anything else: too big, too deep, not UTF-8, not JSON.
    Never RecursionError, whatever the input.
    """
    size = len(raw.encode() if isinstance(raw, str) else raw)
    if size > max_bytes:
        raise SchemaError(source, [f"{size} bytes exceeds the {max_bytes}-byte limit"])
    try:
        data = pydantic_core.from_json(raw)
    except ValueError as exc:  # not JSON, not UTF-8, or deeper than pydantic-core's own limit (~200)
        reason = str(exc)
        if "recursion limit" in reason:
            raise SchemaError(source, [f"nested deeper than {max_depth} levels"]) from exc
        raise SchemaError(source, [f"not valid JSON: {reason}"]) from exc
    if check_depth(data, max_depth) is not None:
        raise SchemaError(source, [f"nested deeper than {max_depth} levels"])
    return data
