"""The gateway's listening socket (gateway.http.connections), with real sockets on the loopback.

Runs in the pytest process; no gateway. What accept() keeps: every accepted connection has Nagle's
algorithm off (asyncio turns it off only for sockets created with proto IPPROTO_TCP, which ours are
not; with it on, a kept-alive connection's streamed chunks waited behind the client's delayed ACKs),
and connections beyond the per-client cap are refused at once. Binding: a port in use is a
`ListenError` that names the address, unless every listener on it set SO_REUSEPORT
(`server.reuse_port`), and then the kernel spreads new connections over all of them.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from gateway.http.connections import ListenError, ListenerSocket, listen


@pytest.fixture
def listener() -> Iterator[ListenerSocket]:
    sock = listen("127.0.0.1", 0, max_total=8, max_per_client=2)
    sock.listen(8)
    yield sock
    sock.close()


def connect(listener: ListenerSocket) -> socket.socket:
    return socket.create_connection(listener.getsockname()[:2], timeout=5)


def accepted(listener: ListenerSocket) -> socket.socket:
    listener.setblocking(True)
    try:
        connection, _ = listener.accept()
    finally:
        listener.setblocking(False)
    return connection


def test_every_accepted_connection_sends_without_nagle(listener: ListenerSocket) -> None:
    client = connect(listener)
    connection = accepted(listener)
    try:
        assert connection.proto == 0  # so asyncio's own TCP_NODELAY is skipped: ours must be there
        assert connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        connection.sendall(b"chunk")
        assert client.recv(16) == b"chunk"
    finally:
        connection.close()
        client.close()
    assert listener.stats.open == 0


def test_a_connection_over_the_per_client_cap_is_refused_and_the_kept_ones_counted(
    listener: ListenerSocket,
) -> None:
    clients = [connect(listener) for _ in range(3)]
    kept = [accepted(listener), accepted(listener)]
    try:
        assert listener.stats.open == 2
        # The third, already in the backlog (its handshake is done), is reset inside the next
        # accept(), which then finds the backlog empty.
        with pytest.raises(BlockingIOError):
            listener.accept()
        assert listener.stats.refused == 1
        with pytest.raises(ConnectionResetError):
            clients[2].recv(1)
    finally:
        for sock in kept + clients:
            sock.close()
    assert listener.stats.open == 0 and not listener.stats.per_client


def test_a_port_in_use_is_an_error_that_names_the_address(listener: ListenerSocket) -> None:
    port = listener.getsockname()[1]
    with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port}: .*server.reuse_port"):
        listen("127.0.0.1", port, max_total=8, max_per_client=2)


def test_listeners_that_all_reuse_the_port_share_its_connections() -> None:
    first = listen("127.0.0.1", 0, max_total=64, max_per_client=64, reuse_port=True)
    port = first.getsockname()[1]
    second = listen("127.0.0.1", port, max_total=64, max_per_client=64, reuse_port=True)
    listeners = (first, second)
    clients: list[socket.socket] = []
    try:
        for sock in listeners:
            sock.listen(64)
        # The kernel picks a listener per connection by its addresses: 32 connections from as many
        # ports all land on one of two with a chance of 2 in 2**32.
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(32)]
        taken = [0, 0]
        for index, sock in enumerate(listeners):
            while True:
                try:
                    connection, _ = sock.accept()
                except BlockingIOError:
                    break
                taken[index] += 1
                connection.close()
        assert sum(taken) == 32 and min(taken) >= 1, taken
        with pytest.raises(ListenError):  # one that does not ask to share it is still refused
            listen("127.0.0.1", port, max_total=8, max_per_client=2)
    finally:
        for client in clients:
            client.close()
        for sock in listeners:
            sock.close()
