"""What the compiler, the fleet and the agent agree on. Imports only pydantic, PyYAML and the stdlib."""

if __name__ != "edgefleet.protocol":  # the folder protocol/ is installed as edgefleet.protocol (pyproject.toml)
    raise ImportError(f"import edgefleet.protocol, not {__name__}: edgefleet installs one top-level name")

__version__ = "0.1.0"
