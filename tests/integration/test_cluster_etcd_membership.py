"""Worker membership through a real etcd: workers register on leases, a gateway's view follows,
a worker that dies leaves when its lease expires, and the view survives etcd going away.

Runs in the pytest process: etcd (Debian's etcd-server, on free loopback ports, data in the test's
temp dir), `Registration`s in this process or in a child process that is SIGKILLed, and one
`EtcdMembership`. Every wait is on a membership change, with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aetcd
import pytest

from gateway.cluster.etcd_membership import EtcdMembership
from gateway.cluster.membership import Capacity, MembershipChange, WorkerRecord
from gateway.cluster.settings import EtcdSettings
from model_worker.registration import Registration
from tests.etcd_server import EtcdServer
from tests.harness import REPO_ROOT, async_wait_until

TTL_S = 3
CHANGE_TIMEOUT_S = 20.0
# etcd looks for expired leases every 500 ms; the deleted key then reaches the watch.
EXPIRY_SLACK_S = 1.5


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


def settings(etcd: EtcdServer, prefix: str) -> EtcdSettings:
    return EtcdSettings(
        endpoints=[etcd.endpoint],
        prefix=prefix,
        worker_ttl_s=TTL_S,
        leader_ttl_s=TTL_S,
        request_timeout_s=0.5,
        retry_interval_s=0.2,
    )


def record(model: str, replica: int, port: int) -> WorkerRecord:
    return WorkerRecord(
        worker_id=f"{model}@host-{replica}",
        model=model,
        replica=replica,
        endpoint=f"tcp://10.0.0.{replica + 1}:{port}",
        public_key="rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7",
        capacity=Capacity(max_jobs=8, max_queue=32),
        protocol_version=3,
    )


def registration(etcd: EtcdServer, prefix: str, worker: WorkerRecord) -> Registration:
    return Registration(
        worker, [etcd.endpoint], prefix=prefix, ttl_s=TTL_S, request_timeout_s=0.5, retry_interval_s=0.2
    )


async def next_change(changes: AsyncIterator[MembershipChange]) -> MembershipChange:
    return await asyncio.wait_for(anext(changes), CHANGE_TIMEOUT_S)


def prefix() -> str:
    return f"/test-{uuid.uuid4().hex[:8]}/"


def test_registered_workers_join_with_their_record_and_leave_when_they_stop(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        where = prefix()
        first, second = record("qwen", 0, 5555), record("qwen", 1, 5556)
        early = registration(etcd, where, first)
        await early.start()
        await early.wait_registered()
        membership = EtcdMembership(settings(etcd, where))
        await membership.start()
        changes = membership.changes()
        try:
            # The initial listing: a join for the worker already there, with every field intact.
            assert await next_change(changes) == MembershipChange("join", first)
            await membership.synced()
            assert membership.connected and dict(membership.members()) == {first.worker_id: first}
            # The watch: a worker that registers later.
            late = registration(etcd, where, second)
            await late.start()
            assert await next_change(changes) == MembershipChange("join", second)
            # A worker that stops revokes its lease: it leaves at once, not after the TTL.
            stopped_at = time.monotonic()
            await early.stop()
            assert await next_change(changes) == MembershipChange("leave", first)
            assert time.monotonic() - stopped_at < TTL_S
            assert list(membership.members()) == [second.worker_id]
            await late.stop()
            assert await next_change(changes) == MembershipChange("leave", second)
        finally:
            await membership.stop()

    asyncio.run(scenario())


WORKER_SCRIPT = """
import asyncio, sys
from gateway.cluster.membership import WorkerRecord
from model_worker.registration import Registration

async def main():
    record = WorkerRecord.model_validate_json(sys.argv[1])
    registration = Registration(record, [sys.argv[2]], prefix=sys.argv[3], ttl_s=int(sys.argv[4]),
                                request_timeout_s=0.5, retry_interval_s=0.2)
    await registration.start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_a_worker_killed_leaves_when_its_lease_expires(etcd: EtcdServer) -> None:
    async def scenario() -> None:
        where = prefix()
        worker = record("llama", 0, 6000)
        membership = EtcdMembership(settings(etcd, where))
        await membership.start()
        changes = membership.changes()
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        args = [
            sys.executable,
            "-c",
            WORKER_SCRIPT,
            worker.model_dump_json(),
            etcd.endpoint,
            where,
            str(TTL_S),
        ]
        process = subprocess.Popen(args, env=env)
        try:
            assert await next_change(changes) == MembershipChange("join", worker)
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=10)
            killed_at = time.monotonic()
            assert await next_change(changes) == MembershipChange("leave", worker)
            took = time.monotonic() - killed_at
            # It refreshed at most TTL/3 before dying, so etcd keeps it at least 2/3 of the TTL more;
            # and forgets it by the TTL (plus etcd's expiry check and the watch).
            assert TTL_S * 2 / 3 - 0.5 <= took <= TTL_S + EXPIRY_SLACK_S, took
            assert not membership.members()
        finally:
            process.kill()
            process.wait()
            await membership.stop()

    asyncio.run(scenario())


def test_the_view_outlives_etcd_and_catches_up_when_it_is_back(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    """etcd is killed: the view keeps its workers; meanwhile one worker stops and one starts. When
    etcd is back the view gets exactly that difference, and nothing for the worker that stayed."""
    caplog.set_level(logging.INFO, logger="gateway.cluster")

    async def scenario() -> None:
        where = prefix()
        stays, goes, comes = record("qwen", 0, 5555), record("qwen", 1, 5556), record("qwen", 2, 5557)
        staying, going = registration(etcd, where, stays), registration(etcd, where, goes)
        coming = registration(etcd, where, comes)
        marker = registration(etcd, where, record("marker", 0, 7000))
        membership = EtcdMembership(settings(etcd, where))
        for started in (staying, going, membership):
            await started.start()
        changes = membership.changes()
        try:
            joined = {(await next_change(changes)).record.worker_id for _ in range(2)}
            assert joined == {stays.worker_id, goes.worker_id}

            etcd.kill()
            await async_wait_until(lambda: not membership.connected, "the membership to see etcd gone")
            assert set(membership.members()) == {stays.worker_id, goes.worker_id}
            await going.stop()  # its lease cannot be revoked now: it will expire after etcd is back
            await coming.start()  # keeps trying until etcd answers
            assert set(membership.members()) == {stays.worker_id, goes.worker_id}
            assert not coming.registered

            etcd.start()
            await async_wait_until(lambda: membership.connected, "the membership to reconnect")
            seen = [await next_change(changes) for _ in range(2)]
            assert sorted((c.kind, c.record.worker_id) for c in seen) == [
                ("join", comes.worker_id),
                ("leave", goes.worker_id),
            ]
            assert set(membership.members()) == {stays.worker_id, comes.worker_id}
            assert staying.registered and coming.registered
            # Nothing else is queued: the next change is the marker's join.
            await marker.start()
            assert await next_change(changes) == MembershipChange("join", marker.record)
        finally:
            for stopped in (staying, coming, marker, membership):
                await stopped.stop()
        messages = [r.getMessage() for r in caplog.records]
        assert any("routing goes on with the last membership (2 workers)" in m for m in messages), messages
        assert any("etcd reachable again" in m for m in messages), messages

    asyncio.run(scenario())


def test_unreadable_records_are_skipped_with_a_warning(
    etcd: EtcdServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        where = prefix()
        good = record("qwen", 0, 5555)
        async with aetcd.Client(host="127.0.0.1", port=etcd.client_port) as client:
            await client.put(f"{where}workers/broken@x".encode(), b"{not json")
            await client.put(f"{where}workers/liar@x".encode(), good.encode())  # names another worker
            await client.put(f"{where}workers/{good.worker_id}".encode(), good.encode())
            membership = EtcdMembership(settings(etcd, where))
            await membership.start()
            try:
                await membership.synced()
                assert list(membership.members()) == [good.worker_id]
                # A record that turns unreadable in place leaves.
                await client.put(f"{where}workers/{good.worker_id}".encode(), b'{"model": 3}')
                changes = membership.changes()
                assert await next_change(changes) == MembershipChange("join", good)
                assert await next_change(changes) == MembershipChange("leave", good)
            finally:
                await membership.stop()
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("broken@x" in w for w in warnings) and any("liar@x" in w for w in warnings), warnings

    asyncio.run(scenario())
