"""Installed as ``edgefleet.agent``: the folder agent/ in the repository, one import name in site-packages."""

if __name__ != "edgefleet.agent":  # the folder agent/ is installed as edgefleet.agent (pyproject.toml)
    raise ImportError(f"import edgefleet.agent, not {__name__}: edgefleet installs one top-level name")
