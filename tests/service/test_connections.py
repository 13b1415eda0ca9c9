"""The server's connection I/O on a real Unix socket: when queued tickets go out."""

from __future__ import annotations

import selectors
import socket
import time

from globalloader.service import connections, protocol
from globalloader.service.connections import HOLD_TICKETS, Connections


def _ticket(seq: int) -> tuple:
    return ("ticket", 0, seq, seq, 64 * seq, (64, (1, 0, "|u1", (64,))))


def _received(client: socket.socket, framer: protocol.Framer) -> list[tuple]:
    """Every message the client can read now (non-blocking), batches unpacked."""
    out: list[tuple] = []
    while True:
        try:
            data = client.recv(1 << 20)
        except BlockingIOError:
            return out
        for msg in framer.feed(data):
            out.extend(msg[1] if msg[0] == "batch" else [msg])


def test_tickets_wait_for_company_until_enough_wait_time_is_up_another_message_goes_or_none_is_coming(
    tmp_path, monkeypatch
):
    # A long hold while the other rules are checked, so a stalled test process cannot let time
    # release the tickets first; a short one for the time rule itself.
    monkeypatch.setattr(connections, "HOLD_S", 60.0)
    selector = selectors.DefaultSelector()
    io = Connections(tmp_path / "s.sock", selector, lambda conn, msg: None, lambda conn, why: None)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(str(tmp_path / "s.sock"))
    client.setblocking(False)
    try:
        for key, mask in selector.select(timeout=5):
            key.data(mask)  # the accept
        (conn,) = io.connections.values()
        framer, busy = protocol.Framer(), lambda c: False

        io.send(conn, *_ticket(0))
        due = io.post_all(busy)
        assert due is not None and 0 < due <= connections.HOLD_S, "held, with the time it is due"
        assert _received(client, framer) == []
        assert io.post_all(lambda c: True) is None, "nothing else on its way: sent now"
        assert _received(client, framer) == [_ticket(0)]

        for seq in range(1, HOLD_TICKETS):
            io.send(conn, *_ticket(seq))
        assert io.post_all(busy) is not None and _received(client, framer) == []
        io.send(conn, *_ticket(HOLD_TICKETS))
        assert io.post_all(busy) is None, "enough tickets: one frame"
        assert _received(client, framer) == [_ticket(seq) for seq in range(1, HOLD_TICKETS + 1)]

        monkeypatch.setattr(connections, "HOLD_S", 0.05)
        io.send(conn, *_ticket(50))
        assert io.post_all(busy) is not None
        time.sleep(2 * connections.HOLD_S)
        assert io.post_all(busy) is None, "held no longer than HOLD_S"
        assert _received(client, framer) == [_ticket(50)]

        io.send(conn, *_ticket(99))
        io.send(conn, "heartbeat", None)
        assert io.post_all(busy) is None
        assert _received(client, framer) == [_ticket(99), ("heartbeat", None)], "in order, with the other message"
    finally:
        client.close()
        io.close_all()
