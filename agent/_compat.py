"""What the agent needs from Python 3.11 that 3.10 lacks (JetPack 6 and Ubuntu 22.04 ship 3.10).

The agent and ``protocol/`` support Python 3.10 and newer (``make lint`` checks with vermin, ``make
test-py310`` runs their tests on 3.10). Keep this module small: one backport per need.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["run_with_loop"]

_T = TypeVar("_T")


def run_with_loop(main: Coroutine[Any, Any, _T],
                  loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> _T:
    """``asyncio.Runner(loop_factory=loop_factory).run(main)``: on 3.11+ exactly that; on 3.10 the same steps
    as ``asyncio.run`` on a loop made by ``loop_factory`` (cancel what is left, finish async generators and
    the default executor, close the loop)."""
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=loop_factory) as runner:  # novermin (3.11+ only, as checked above)
            return runner.run(main)
    loop = loop_factory() if loop_factory is not None else asyncio.new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        try:
            left = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in left:
                t.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
