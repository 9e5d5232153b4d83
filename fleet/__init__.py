"""Installed as ``edgefleet.fleet``: the folder fleet/ in the repository, one import name in site-packages."""
