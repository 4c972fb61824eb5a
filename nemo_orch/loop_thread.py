"""An asyncio event loop in a background thread, for callers on other threads whose work is
async and shares started resources (a toolbox, a scorer and its clients): servers whose requests
arrive on threads of their own (PyTriton's, ``http.server``'s), and GRPO's rollouts, which run
ahead on it while the trainer trains. Every call runs on this one loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any


class LoopThread:
    """A running loop; ``submit`` and ``run`` are called from other threads."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, coroutine: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """``coroutine``'s result, once it ran on the loop."""
        return self.submit(coroutine).result()

    def stop(self) -> None:
        """Stop the loop, join its thread and close it (again: nothing)."""
        if self.alive:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()
