"""`prefixgate serve --workers N`: N gateway processes on one port, supervised, routing as one.

One Python process tops out at one core. The parent here serves nothing: it reserves the port (a
socket bound with SO_REUSEPORT, never listening, so that port 0 picks one port for all), starts N
`prefixgate serve` processes that each listen on it with SO_REUSEPORT once they are ready (the kernel
spreads new connections among the listening ones only: a process still starting, or one that died,
takes none), and relays what they tell each other (gateway.sync.siblings) over a socket pair each. A
process that exits unexpectedly is restarted, with backoff; the others are told it is gone.
SIGINT/SIGTERM stop them all (each finishes its requests as `serve` does), SIGHUP reloads them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable

from gateway.sync.sibling_wire import EVERYONE, HEADER, SEND_BUFFER_BYTES, frame, read_frame
from protocol.backoff import Backoff

log = logging.getLogger("prefixgate.gateway.processes")

# A process that ran this long before it exited is restarted at once (its exit was not a start-up loop).
STEADY_S = 30.0
RESTART_MAX_S = 30.0
# How long the processes get to finish their requests when the group stops, before they are killed.
STOP_WAIT_S = 30.0

# (process index, its end of the relay, the port) -> its command line.
Command = Callable[[int, int, int], list[str]]


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) with SO_REUSEPORT and not listening: it holds the port (the one
    the system picked, for port 0) for the processes to listen on, and receives no connection."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    return sock


class ProcessGroup:
    """`count` processes on `port` made by `command`, kept running."""

    def __init__(self, command: Command, count: int, port: int) -> None:
        self.command = command
        self.port = port
        self.count = count
        self.processes: dict[int, asyncio.subprocess.Process] = {}
        self.dropped = 0
        self._links: dict[int, asyncio.StreamWriter] = {}
        self._stopping = False

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._signal_all, signal.SIGHUP)
        keepers = [asyncio.create_task(self._keep(k), name=f"process:{k}") for k in range(self.count)]
        await stop.wait()
        log.info("stopping %d gateway processes", len(self.processes))
        self._stopping = True
        self._signal_all(signal.SIGTERM)
        waits = [asyncio.create_task(p.wait()) for p in self.processes.values()]
        if waits:
            _, late = await asyncio.wait(waits, timeout=STOP_WAIT_S)
            if late:
                log.warning("%d gateway processes did not stop in %.0f s: killed", len(late), STOP_WAIT_S)
                self._signal_all(signal.SIGKILL)
                await asyncio.wait(waits)
        for keeper in keepers:
            keeper.cancel()
        await asyncio.gather(*keepers, return_exceptions=True)
        return 0

    def _signal_all(self, sig: signal.Signals) -> None:
        for process in self.processes.values():
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(sig)

    async def _keep(self, index: int) -> None:
        backoff = Backoff(first_s=1.0, most_s=RESTART_MAX_S)
        while not self._stopping:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            with theirs:
                process = await asyncio.create_subprocess_exec(
                    *self.command(index, theirs.fileno(), self.port), pass_fds=(theirs.fileno(),)
                )
            self.processes[index] = process
            started = time.monotonic()
            reader, writer = await asyncio.open_unix_connection(sock=ours)
            self._links[index] = writer
            relay = asyncio.create_task(self._relay(index, reader, process), name=f"relay:{index}")
            code = await process.wait()
            relay.cancel()
            await asyncio.gather(relay, return_exceptions=True)
            del self._links[index]
            writer.close()
            self._send(frame([("gone", index)]), EVERYONE, index)
            if self._stopping:
                return
            if time.monotonic() - started >= STEADY_S:
                backoff.succeeded()
            delay = backoff.failed()
            log.error("gateway process %d exited (%s); restarting it in %.0f s", index, code, delay)
            await asyncio.sleep(delay)

    async def _relay(
        self, index: int, reader: asyncio.StreamReader, process: asyncio.subprocess.Process
    ) -> None:
        try:
            while True:
                to, payload = await read_frame(reader)
                self._send(HEADER.pack(to, len(payload)) + payload, to, index)
        except (asyncio.IncompleteReadError, ConnectionError):
            return  # it exited
        except ValueError as error:
            # Its frames no longer make sense: it is restarted rather than left half-connected.
            log.error("gateway process %d sent a broken frame (%s): restarting it", index, error)
            with contextlib.suppress(ProcessLookupError):
                process.kill()

    def _send(self, data: bytes, to: int, sender: int) -> None:
        for index, writer in self._links.items():
            if index == sender or (to != EVERYONE and index != to) or writer.is_closing():
                continue
            if writer.transport.get_write_buffer_size() > SEND_BUFFER_BYTES:
                if self.dropped == 0:
                    log.warning("gateway process %d is not reading its siblings' messages: dropping", index)
                self.dropped += 1
                continue
            writer.write(data)


def run(command: Command, count: int, host: str, port: int) -> int:
    """Serve with `count` processes on (host, port) until SIGINT or SIGTERM."""
    try:
        reserved = reserve_port(host, port)
    except OSError as error:
        print(f"prefixgate serve: cannot listen on {host}:{port}: {error}", file=sys.stderr)
        return 2
    with reserved:
        port = reserved.getsockname()[1]
        log.info("serving on %s:%d with %d gateway processes", host, port, count)
        return asyncio.run(ProcessGroup(command, count, port).run())
