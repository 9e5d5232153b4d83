"""edgefleet's command line and local demo; the parts live in ``protocol``, ``compiler``, ``fleet`` and ``agent``."""

from edgefleet.protocol import __version__

__all__ = ["__version__"]
