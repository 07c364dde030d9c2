"""Rank 0's Unix socket: the only way into a cluster's trainer.

Connections are handled on threads with I/O timeouts (a stalled client holds nothing): each sends one frame.
`train` requests queue for the ranks' thread, which answers them in order (``Boundary.serve``); any other op is
answered at once on the connection's thread, even mid-round, and, saying nothing of the data, under secure
aggregation's rule whatever the round.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from typing import Any

from nebula_fl.clients.outgoing import released
from nebula_fl.clients.protocol import TrainerListener, unpack
from nebula_fl.clients.trainer_options import TrainerOptions, log

MAX_FRAME = 1 << 31


class TrainerSocket:
    """Accepts connections and reads their frames; `answer_now(op, header)` is the frame for any op but `train`."""

    def __init__(self, *, opts: TrainerOptions, answer_now: Callable[[Any, dict[str, Any]], bytes]) -> None:
        self.opts, self.answer_now = opts, answer_now
        self.jobs: queue.Queue = queue.Queue()  # (connection, train header with its arrays), for the ranks' thread

    def start(self, listener: TrainerListener) -> None:
        threading.Thread(target=self._accept_loop, args=(listener,), daemon=True, name="accept").start()

    def reply(self, conn: Any, frame: bytes) -> None:
        """Send a round's frame on its connection (the ranks' thread); a ClientApp gone away finds it cached."""
        with conn:
            try:
                conn.send_bytes(frame)
            except OSError as err:
                log(self.opts, f"could not send the reply (the ClientApp went away: {err}); it stays cached",
                    error=True)

    def _accept_loop(self, listener: TrainerListener) -> None:
        while True:
            try:
                raw = listener.accept_raw()
            except OSError as err:
                log(self.opts, f"accept failed: {err}", error=True)
                time.sleep(0.1)
                continue
            threading.Thread(target=self._handle, args=(listener, raw), daemon=True, name="connection").start()

    def _handle(self, listener: TrainerListener, raw) -> None:
        try:
            conn = listener.handshake(raw)
        except (AuthenticationError, OSError, EOFError) as err:  # a wrong key, or a client that stalls or hangs up
            log(self.opts, f"refused a connection: {err or type(err).__name__}", error=True)
            raw.close()
            return
        try:
            header, arrays = unpack(conn.recv_bytes(MAX_FRAME))
        except (EOFError, OSError, ValueError) as err:
            log(self.opts, f"unreadable request: {err or type(err).__name__}", error=True)
            conn.close()
            return
        op = header.get("op")
        if op == "train":
            self.jobs.put((conn, {**header, "arrays": arrays}))  # answered by the ranks' thread, in order
            return
        frame = self.answer_now(op, header)
        with conn:
            try:  # neither says anything of the data: held to secure aggregation's rule whatever the round
                conn.send_bytes(released(frame, secure=True))
            except OSError:
                pass
