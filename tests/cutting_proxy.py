"""A TCP proxy on loopback that stands in for a bad link: it cuts each connection after ``cut_every`` bytes from
the server (``max_cuts`` times at most; 0: always), can wait ``head_delay_s`` before it forwards an
answer, can strip the Range header of the requests it forwards (a server or cache that ignores ranges), and
counts the bytes it carried back. Used by tests/test_resume_download.py and bench/bad_link.py (where
network namespaces are not allowed)."""

from __future__ import annotations

import contextlib
import queue
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["CuttingProxy"]

_RANGE = re.compile(rb"\r\nRange:[^\r\n]*", re.IGNORECASE)


@dataclass
class CuttingProxy:
    upstream_port: int
    upstream_host: str = "127.0.0.1"
    host: str = "127.0.0.1"  # where it listens
    port: int = 0
    cut_every: int = 0  # 0: never
    max_cuts: int = 0  # 0: no limit
    cuts: int = 0
    strip_range: bool = False
    head_delay_s: float = 0.0
    delay_s: float = 0.0  # latency added to every chunk towards the client (a queue, not a throttle)
    down_bytes: int = 0  # bytes carried from the server to the client, all connections
    connections: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> int:
        self._srv = socket.create_server((self.host, self.port))
        self._srv.settimeout(0.5)
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()
        return int(self._srv.getsockname()[1])

    def stop(self) -> None:
        self._stop.set()
        self._srv.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            up = socket.create_connection((self.upstream_host, self.upstream_port), timeout=30)
        except OSError:
            client.close()
            return
        client.settimeout(30)
        budget = self.cut_every if self.cut_every and (not self.max_cuts or self.cuts < self.max_cuts) else -1

        def upward() -> None:
            with contextlib.suppress(OSError):
                while data := client.recv(65536):
                    up.sendall(_RANGE.sub(b"", data) if self.strip_range else data)
            with contextlib.suppress(OSError):
                up.shutdown(socket.SHUT_WR)

        threading.Thread(target=upward, daemon=True).start()
        try:
            delayed = False
            for data in self._delayed(up) if self.delay_s else iter(lambda: up.recv(65536), b""):
                if self.head_delay_s and not delayed:
                    time.sleep(self.head_delay_s)
                    delayed = True
                if budget >= 0:
                    data = data[:budget]
                    budget -= len(data)
                client.sendall(data)
                with self.lock:
                    self.down_bytes += len(data)
                if budget == 0:
                    with self.lock:
                        self.cuts += 1
                    break  # the cut
        except OSError:
            pass
        finally:
            for s in (client, up):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


    def _delayed(self, up: socket.socket) -> Iterator[bytes]:
        """What ``up`` sends, each chunk ``delay_s`` after it arrived (read on as it waits: latency, not a throttle)."""
        q: queue.Queue[tuple[float, bytes]] = queue.Queue(maxsize=4096)

        def reader() -> None:
            with contextlib.suppress(OSError):
                while data := up.recv(65536):
                    q.put((time.monotonic() + self.delay_s, data))
            q.put((time.monotonic() + self.delay_s, b""))

        threading.Thread(target=reader, daemon=True).start()
        while True:
            due, data = q.get(timeout=120)
            time.sleep(max(0.0, due - time.monotonic()))
            if not data:
                return
            yield data


if __name__ == "__main__":  # a plain relay, run inside a network namespace by tests/bad_link.py
    import sys

    listen_host, listen_port, up_host, up_port, delay_s = sys.argv[1:6]
    relay = CuttingProxy(int(up_port), up_host, listen_host, int(listen_port), delay_s=float(delay_s))
    relay.start()
    print("relaying", flush=True)
    relay._stop.wait(3600)  # bounded: the test kills it long before
