"""A loopback TCP proxy the fault scenarios put between one process and Redis or the policy server,
to partition, slow or stall it without network namespaces (which need privileges CI may lack).

    proxy = Proxy(("127.0.0.1", redis_port)).start()    # listens on 127.0.0.1:proxy.port
    proxy.blackhole()     # a partition: nothing is forwarded either way, new connections hang
    proxy.heal()          # forwarding resumes; nothing held back is lost (TCP does not lose bytes)
    proxy.delay_s = 0.05  # a slow link: every chunk forwarded this much later
    proxy.stall_after(n)  # the connection whose replies pass n more bytes stops getting replies
    proxy.close()

A partition here holds bytes back instead of dropping packets: what the kernel sees is a peer that
stopped reading, as a cable pulled for less than TCP's retransmission timeout. Each connection
reads at most 64 KiB ahead of what it forwarded, so a held-back peer sees TCP back-pressure.
"""

from __future__ import annotations

import asyncio
import threading


class Proxy:
    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.port = 0
        self.delay_s = 0.0
        self.connections = 0  # accepted so far
        self.stalled_connections = 0  # cut off by stall_after
        self._open = None  # asyncio.Event: set = forwarding
        self._stall_budget: int | None = None  # reply bytes left before the next connection stalls
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> Proxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    async def _listen(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, scheme: str = "redis") -> str:
        return f"{scheme}://{self.address}"

    def blackhole(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    def stall_after(self, nbytes: int) -> None:
        """The connection whose replies (target -> client) cross `nbytes` more bytes from now gets no
        reply byte past that point, ever (its client must give up on it); later ones flow."""

        def arm() -> None:
            self._stall_budget = nbytes

        self._loop.call_soon_threadsafe(arm)

    def close(self) -> None:
        async def shutdown() -> None:
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        self._tasks.add(task)
        try:
            await self._open.wait()  # a partition: the connection is accepted (SYN-ACKed) and hangs
            target_r, target_w = await asyncio.open_connection(*self.target)
        except (OSError, asyncio.CancelledError):
            client_w.close()
            self._tasks.discard(task)
            return
        stalled = asyncio.Event()  # this connection's replies stopped for good
        pumps = [
            asyncio.ensure_future(self._pump(client_r, target_w, None)),
            asyncio.ensure_future(self._pump(target_r, client_w, stalled)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for w in (client_w, target_w):
                w.close()
            self._tasks.discard(task)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, stalled: asyncio.Event | None):
        """Forward src -> dst; `stalled` is given for the reply direction only (stall_after)."""
        try:
            while True:
                data = await src.read(1 << 16)
                if not data:
                    break
                await self._open.wait()
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                if stalled is not None and (stalled.is_set() or self._stall_budget is not None):
                    if not stalled.is_set() and len(data) < self._stall_budget:
                        self._stall_budget -= len(data)
                    else:
                        if not stalled.is_set():
                            data, self._stall_budget = data[: self._stall_budget], None
                            stalled.set()
                            self.stalled_connections += 1
                            dst.write(data)
                        await asyncio.Event().wait()  # held until the client closes this connection
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            try:
                dst.write_eof()
            except (OSError, RuntimeError):
                pass
