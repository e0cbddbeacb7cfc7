"""Running a blocking generator (the engine's loop) in its own thread, consumed from asyncio."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator

_DONE = object()


async def iterate_in_thread(make: Callable[[threading.Event], Iterator]) -> AsyncIterator:
    """Yield what `make(cancelled)` yields, produced in a dedicated thread.

    When the consumer goes away (cancellation, client disconnect), `cancelled` is set; the generator
    sees it between rounds, stops, and closes itself in its own thread (releasing its caches there).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()

    def send(item: object, exc: BaseException | None = None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, (item, exc))
        except RuntimeError:  # the event loop is gone: nobody is listening any more
            cancelled.set()

    def produce() -> None:
        items = make(cancelled)
        try:
            for item in items:
                send(item)
                if cancelled.is_set():
                    break
        except BaseException as exc:  # delivered to the consumer, re-raised there
            send(_DONE, exc)
            return
        finally:
            items.close()
        send(_DONE)

    thread = threading.Thread(target=produce, daemon=True, name="dflash-generate")
    thread.start()
    try:
        while True:
            item, exc = await queue.get()
            if item is _DONE:
                if exc is not None:
                    raise exc
                return
            yield item
    finally:
        cancelled.set()
