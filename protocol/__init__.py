"""What the compiler, the fleet and the agent agree on. Imports only pydantic, PyYAML and the stdlib."""

__version__ = "0.1.0"
