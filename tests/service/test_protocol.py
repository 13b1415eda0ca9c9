"""The wire format: typed messages, and a round of them sent as one checked "batch" frame."""

from __future__ import annotations

import pickle

import pytest

from globalloader.errors import ProtocolError
from globalloader.service import protocol


def test_a_round_of_tickets_travels_as_one_frame_and_other_messages_as_their_own():
    tickets = [("ticket", 0, seq, 7 + seq, 64 * seq, (64, (1, 0, "|u1", (64,)))) for seq in range(3)]
    failed = ("failed", 0, 3, 10, "TransformError", "sample 10: bad")
    framer = protocol.Framer()
    assert framer.feed(protocol.frame_all([*tickets, failed])) == [("batch", (*tickets, failed))]
    assert framer.feed(protocol.frame_all(tickets[:1])) == [tickets[0]]
    data = protocol.frame_all([tickets[0], ("heartbeat", None), *tickets[1:], ("error", "ServerError", "x")])
    assert framer.feed(data[:10]) == []  # a frame split across reads waits for its end
    assert framer.feed(data[10:]) == [
        tickets[0],
        ("heartbeat", None),
        ("batch", tuple(tickets[1:])),
        ("error", "ServerError", "x"),
    ], "in order"


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ((("launch", 1),), "unknown message"),
        ((("ticket", 0, 1),), "needs fields"),
        ((("batch", ()),), "holds only"),
        ((("heartbeat", None),), "holds only"),
        ([("stopping",)], "a tuple of messages"),
    ],
)
def test_a_malformed_batch_is_refused_whole(messages, says):
    with pytest.raises(ProtocolError, match=says):
        protocol.parse(pickle.dumps(("batch", messages)))


def test_a_batch_is_built_only_of_known_messages():
    with pytest.raises(ProtocolError, match="unknown message"):
        protocol.frame_all([("ticket", 0, 1, 2, 3, None), ("launch", 1)])
