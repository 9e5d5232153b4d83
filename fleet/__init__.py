"""Installed as ``edgefleet.fleet``: the folder fleet/ in the repository, one import name in site-packages."""

if __name__ != "edgefleet.fleet":  # the folder fleet/ is installed as edgefleet.fleet (pyproject.toml)
    raise ImportError(f"import edgefleet.fleet, not {__name__}: edgefleet installs one top-level name")
