"""Errors shared by every part of edgefleet.

Tree, split by who is at fault::

    EdgefleetError
    ├── ContractError          a document (manifest, profile, message) breaks the contract
    │   ├── SchemaError        unknown key, missing key, wrong type; names the file and the key
    │   └── UnsupportedVersionError  the document is newer than this code understands
    └── ConfigError            a config file or flag given by the operator is wrong

Each package (``agent``, ``compiler``, ``fleet``) derives its own tree from these.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ContractError",
    "EdgefleetError",
    "SchemaError",
    "UnsupportedVersionError",
]


class EdgefleetError(Exception):
    """Base of every error edgefleet raises on purpose."""


class ContractError(EdgefleetError):
    """A document exchanged between the parts breaks the contract."""


class SchemaError(ContractError):
    """A document has an unknown key, lacks a key, or holds a value of the wrong type."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        joined = "; ".join(problems)
        super().__init__(f"{source}: {joined}")


class UnsupportedVersionError(ContractError):
    """The document was written for a newer contract than this code understands."""


class ConfigError(EdgefleetError):
    """Operator-supplied configuration is wrong."""
