"""Installed as ``edgefleet.agent``: the folder agent/ in the repository, one import name in site-packages."""
