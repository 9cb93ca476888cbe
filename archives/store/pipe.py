"""A bounded pipe from an async chunk iterator (a download on the event loop) to a blocking
reader in a worker thread (verify + extract), so an archive streams from the store to disk
without ever being written whole.

    pipe = ChunkPipe(depth=8)
    feeder = asyncio.create_task(pipe.feed(store.open_stream(key)))
    manifest = await loop.run_in_executor(pool, extract_archive_stream, pipe, dest, keys)

At most `depth` chunks wait in the pipe (backpressure: the download pauses while the reader is
behind). A failed download reaches the reader as the exception its `read` raises; a reader that
stops early calls `close()` and the feeder's task is cancelled, which closes the download.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator

from archives.errors import StoreError

_EOF = object()


class ChunkPipe:
    """Create on the event loop; `feed` runs there, `read` in one worker thread."""

    def __init__(self, depth: int = 8):
        self._loop = asyncio.get_running_loop()
        self._room = asyncio.Semaphore(depth)
        self._chunks: queue.SimpleQueue = queue.SimpleQueue()  # bounded by _room
        self._buf, self._pos = b"", 0  # the chunk being read, and how far
        self._ended: BaseException | None = None
        self._eof = False
        self._closed = False
        self.nbytes = 0  # bytes handed to the pipe by the download

    async def feed(self, chunks: AsyncIterator[bytes]) -> None:
        """Put every chunk of `chunks` into the pipe, then the end; on failure (or cancellation)
        the reader gets the error instead of the end. The iterator is closed either way."""
        try:
            async for chunk in chunks:
                if not chunk:
                    continue  # b"" means the end to the reader
                await self._room.acquire()
                if self._closed:
                    return
                self._chunks.put(bytes(chunk))
                self.nbytes += len(chunk)
            self._chunks.put(_EOF)
        except asyncio.CancelledError:
            self._chunks.put(StoreError("the download was cancelled"))
            raise
        except Exception as e:
            self._chunks.put(e if isinstance(e, StoreError) else StoreError(f"the download failed: {e!r}"))
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()

    def read(self, n: int = -1) -> bytes:
        """Up to `n` bytes (at least one, unless the stream ended: b""); blocks for the next chunk."""
        if self._pos == len(self._buf):
            if self._eof:
                return b""
            if self._ended is not None:
                raise self._ended
            item = self._chunks.get()
            try:
                self._loop.call_soon_threadsafe(self._room.release)
            except RuntimeError:  # the loop is gone: nothing waits on the room any more
                pass
            if item is _EOF:
                self._eof = True
                return b""
            if isinstance(item, BaseException):
                self._ended = item
                raise item
            self._buf, self._pos = item, 0
        start = self._pos
        self._pos = len(self._buf) if n < 0 else min(len(self._buf), start + n)
        if start == 0 and self._pos == len(self._buf):
            return self._buf  # the whole chunk: no copy
        return self._buf[start : self._pos]

    def close(self) -> None:
        """The reader is done (or gave up): the feeder stops at its next chunk."""
        self._closed = True
