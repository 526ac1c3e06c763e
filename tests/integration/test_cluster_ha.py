"""Past one gateway, for real: three gateways behind HAProxy, etcd, Redis, two workers of one model,
each on a host of its own (network namespaces), under a steady load of streamed completions.

Runs in the pytest process; everything else is a real process (tests.cluster_ha). Each case breaks
one thing under the load and reports the requests sent, finished, failed cleanly and lost; none may
be lost. The cases:
- a gateway killed mid-stream: its clients see the connection end, every other stream finishes,
  and no job of it is left in any worker 2 s later;
- Redis killed: limits fall back to each gateway's own counts, with a log line, and are shared
  again when it is back; the load does not notice;
- a worker's host cut off (its cable pulled): its running requests end with an error event, and
  those it had not started go to the other replica and finish;
- etcd killed: routing goes on with the last membership through every gateway, a worker started
  while etcd is down joins every gateway once it is back;
- the leader killed while an on-demand load it decided is in flight (a request for `ha-lazy`, whose
  worker stood by, waits at a survivor): another gateway leads within the lease's TTL, the worker
  loads exactly once, and the waiting request is served.
Membership is a parameter of the cluster: etcd (the workers register themselves, the gateways
watch and elect a leader); tests.cluster_ha also has a static list, which the last two cases skip.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster_ha import (
    GATEWAYS,
    HEARTBEAT_TIMEOUT_S,
    LAZY_MODEL,
    LEADER_TTL_S,
    LIMITED_KEYS,
    LOAD_KEY,
    MAX_JOBS,
    MODEL,
    WORKER_QUEUE,
    EtcdMembership,
    HaCluster,
    Worker,
    direct_completion,
)
from tests.cluster_ha_load import FAILED, FINISHED, LOST, CaseReport, Load, Record
from tests.harness import settled_workers, wait_until

CONCURRENCY, MAX_TOKENS = 6, 320
JOB_GONE_WITHIN_S = 2.0  # the "no job is left in any worker 2 s later"

# etcd looks for expired leases every 500 ms; the delete then reaches the followers' watch, and one
# campaigns (a transaction). On 2 busy cores that takes a little more than the TTL.
TAKEOVER_MARGIN_S = 2.0
LOADED = "standby: loading on request of the leading gateway"  # the worker's line, once per load


@pytest.fixture(scope="module", params=[EtcdMembership], ids=lambda backend: backend.name)
def cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path
) -> Iterator[HaCluster]:
    with HaCluster(tmp_path_factory.mktemp("ha"), demo_model_dir, request.param()) as cluster:
        yield cluster


def steady_load(cluster: HaCluster, case: str, concurrency: int = CONCURRENCY) -> Load:
    return Load(cluster.haproxy.url, case, model=MODEL, api_key=LOAD_KEY, concurrency=concurrency,
                max_tokens=MAX_TOKENS).start()  # fmt: skip


def reported(report: CaseReport) -> CaseReport:
    print(report)
    assert report.of(FINISHED), report
    assert not report.of(LOST), report
    return report


def etcd_of(cluster: HaCluster) -> EtcdMembership:
    if not isinstance(cluster.membership, EtcdMembership):
        pytest.skip("a case of etcd membership and leadership")
    return cluster.membership


def log_count(cluster: HaCluster, text: str) -> dict[str, int]:
    return {name: cluster.gateway_log(name).count(text) for name in GATEWAYS}


def each_logged(cluster: HaCluster, text: str, before: dict[str, int]) -> None:
    for name in GATEWAYS:
        wait_until(lambda n=name: log_count(cluster, text)[n] > before[n], f"{name} to log {text!r}")


def test_a_gateway_killed_mid_stream(cluster: HaCluster) -> None:
    cluster.heal()
    victim = "gw-2"
    gone_seen: dict[str, tuple[float, int]] = {}  # worker -> (seconds after the kill, jobs cancelled)
    known = {w.worker_id: len(cluster.gone_lines(w, victim)) for w in cluster.workers}
    load = steady_load(cluster, "gateway killed")
    try:
        wait_until(lambda: load.streaming_via(victim), f"a stream through {victim}", poll_s=0.05)
        killed_at = time.monotonic()
        cluster.kill_gateway(victim)

        def every_worker_let_go() -> bool:
            for worker in cluster.workers:
                lines = cluster.gone_lines(worker, victim)
                if len(lines) > known[worker.worker_id] and worker.worker_id not in gone_seen:
                    gone_seen[worker.worker_id] = (time.monotonic() - killed_at, lines[-1][0])
            return len(gone_seen) == len(cluster.workers)

        # Each worker sees the connection break (at once, or at its next frame to it), at the latest
        # when the gateway's pings have been missing for the heartbeat timeout.
        wait_until(every_worker_let_go, f"every worker to let {victim} go", HEARTBEAT_TIMEOUT_S + 5,
                   poll_s=0.05)  # fmt: skip
        wait_until(lambda: load.finished_after(killed_at) >= CONCURRENCY, "the load to go on without it")
    finally:
        report = reported(load.stop())
    print(f"workers let {victim} go (seconds after the kill, its jobs they cancelled): {gone_seen}")
    # Once a worker lets a gateway go it holds none of its jobs (the rest had finished already).
    assert all(after <= JOB_GONE_WITHIN_S for after, _ in gone_seen.values()), gone_seen
    cut = [r for r in report.records if r.gateway == victim and r.first_data and r.ended_after(killed_at)]
    assert cut, report
    for record in cut:  # its clients saw the connection end
        assert record.outcome == FAILED and "connection ended" in record.detail, record
    # Only the victim's requests fail: those cut mid-stream, and those HAProxy had sent it when it
    # died (a 502, or the client's connection closed: they had no answer to carry a header).
    servers = cluster.haproxy.servers_by_request()
    for record in report.of(FAILED):
        assert servers.get(record.rid) == victim and record.ended_after(killed_at), (record, report)
    # Nothing is left in any worker once the load is over (no zombie job of the dead gateway).
    settled_workers(cluster.gateways["gw-1"])


def test_redis_killed_and_back(cluster: HaCluster) -> None:
    cluster.heal()
    gateways = [cluster.gateways[name] for name in GATEWAYS]
    unreachable = log_count(cluster, "Redis unreachable")
    reachable = log_count(cluster, "Redis reachable again")
    load = steady_load(cluster, "redis killed")
    try:
        # Shared: 2 requests a minute for the key across the three gateways.
        assert [direct_completion(g, LIMITED_KEYS["before"]) for g in gateways] == [200, 200, 429]
        cluster.redis.stop()
        stopped_at = time.monotonic()
        each_logged(cluster, "Redis unreachable", unreachable)
        # Each gateway counts alone: 2 a minute on each of three, then its own count refuses.
        assert [direct_completion(g, LIMITED_KEYS["during"]) for g in gateways for _ in (1, 2)] == [200] * 6
        assert direct_completion(gateways[0], LIMITED_KEYS["during"]) == 429
        wait_until(lambda: load.finished_after(stopped_at) >= CONCURRENCY, "the load to go on without Redis")
        cluster.redis.start()
        each_logged(cluster, "Redis reachable again", reachable)
        assert [direct_completion(g, LIMITED_KEYS["after"]) for g in gateways] == [200, 200, 429]
    finally:
        report = reported(load.stop())
    assert not report.of(FAILED), report  # Redis's outage costs no request


# The premise of the case below is a race it cannot rule out: a running job may end, and the waiting
# one start, between the report that shows it waiting and the cut. An attempt that moved no job
# missed the premise (nothing of the gateways was tested), and the case cuts again, this often.
CUT_ATTEMPTS = 3
MOVED_LINE = "failed before starting a job; trying another"  # the gateway's line


def test_a_worker_host_cut_off(cluster: HaCluster) -> None:
    cluster.heal()
    victim = cluster.workers[0]
    gateways = list(cluster.gateways.values())
    missed: list[CaseReport] = []
    for attempt in range(1, CUT_ATTEMPTS + 1):
        let_go = {name: len(cluster.gone_lines(victim, name)) for name in GATEWAYS}
        report = cut_while_a_job_waits(cluster, victim, f"worker host cut off {attempt}")
        ours = {r.rid: r for r in report.records}
        moved = [ours[rid] for rid in cluster.request_ids_logged(MOVED_LINE) if rid in ours]
        cluster.wait_whole()  # the cable back in: every gateway has both replicas again
        if moved:
            break
        print(f"attempt {attempt}: the waiting job started before the cut; nothing was moved")
        missed.append(report)
    else:
        pytest.fail(f"no job was moved off the cut worker in {CUT_ATTEMPTS} attempts: {missed}")

    def full(record: Record) -> bool:  # one replica left: two gateways may race for its last slot
        return record.status == 429 and "worker_full" in record.detail

    # The ones it had not started went to the other replica, and finished there.
    assert any(r.outcome == FINISHED for r in moved), report
    # A moved one that the other replica had refused as full too ends with its last failure.
    assert all(r.outcome == FINISHED or full(r) or "lost contact" in r.detail for r in moved), report
    lost_contact = [r for r in report.of(FAILED) if "lost contact" in r.detail]
    assert lost_contact, report  # the ones it was running ended with an error event
    assert all(r in lost_contact or full(r) for r in report.of(FAILED)), report
    # The victim let every gateway go while it heard nothing from them (their jobs cancelled), ...
    assert all(len(cluster.gone_lines(victim, name)) > n for name, n in let_go.items()), let_go
    settled_workers(gateways[0])  # ... and nothing runs on anywhere.


def cut_while_a_job_waits(cluster: HaCluster, victim: Worker, case: str) -> CaseReport:
    """Cut the victim's host just after it reported a job waiting, under a steady load, until every
    gateway has lost it and the load goes on on the other replica; then mend it."""
    gateways = list(cluster.gateways.values())
    # More clients than one worker's slots, fewer than both's: the victim soon holds a job it has
    # not started (Accepted never came back), and when the gateways see it lost (a heartbeat
    # timeout) and move that job, the other replica has a slot left for it, since the clients
    # whose jobs were on the victim are still waiting. With more clients than both workers' slots
    # the other replica could be full at that moment, and then every moved job ended worker_full.
    load = steady_load(cluster, case, MAX_JOBS + WORKER_QUEUE + 2)
    heartbeats: dict[str, int] = {}

    def just_reported_a_waiting_job() -> bool:
        # Seen in a report that arrived since the last look, so the job has most likely not
        # started yet when the cable is pulled: an older report can be stale.
        for gateway in gateways:
            row = next(w for w in gateway.workers() if w["id"] == victim.worker_id)
            fresh = heartbeats.get(gateway.url, row["heartbeats"]) != row["heartbeats"]
            heartbeats[gateway.url] = row["heartbeats"]
            if fresh and (row["load"] or {}).get("queued"):
                return True
        return False

    try:
        wait_until(just_reported_a_waiting_job, f"a job waiting in {victim.worker_id}", poll_s=0.02)
        victim.host.cut()
        cut_at = time.monotonic()
        for gateway in gateways:
            wait_until(lambda g=gateway: g.worker_state(victim.worker_id) == "lost",
                       f"{gateway.url} to lose {victim.worker_id}", HEARTBEAT_TIMEOUT_S + 10,
                       context=gateway.events)  # fmt: skip
        wait_until(lambda: load.finished_after(cut_at) >= CONCURRENCY, "the load to go on on one replica")
    finally:
        report = reported(load.stop())
        victim.host.mend()
    return report


def test_etcd_killed_and_back(cluster: HaCluster) -> None:
    membership = etcd_of(cluster)
    assert membership.etcd is not None
    cluster.heal()
    spare = cluster.spare
    assert not cluster.running(spare), "the spare runs only from this case on"
    gateways = [cluster.gateways[name] for name in GATEWAYS]
    kept = log_count(cluster, "routing goes on with the last membership (2 workers)")
    back = log_count(cluster, "etcd reachable again")
    load = steady_load(cluster, "etcd killed")
    try:
        membership.etcd.kill()
        killed_at = time.monotonic()
        each_logged(cluster, "routing goes on with the last membership (2 workers)", kept)

        def served_by_every_gateway() -> bool:
            done = [r for r in load.snapshot() if r.outcome == FINISHED and r.started > killed_at]
            return len(done) >= CONCURRENCY and {r.gateway for r in done} == set(GATEWAYS)

        wait_until(served_by_every_gateway, "the load to finish through every gateway without etcd")
        # A worker that starts now cannot register: nobody knows it until etcd is back.
        cluster.start_worker(spare)
        wait_until(lambda: "etcd unreachable" in cluster.worker_log(spare), "the spare to find etcd down",
                   context=lambda: cluster.worker_log(spare))  # fmt: skip
        assert all(g.worker_state(spare.worker_id) is None for g in gateways)
        membership.etcd.start()
        each_logged(cluster, "etcd reachable again", back)
        cluster.wait_ready_everywhere(spare)

        seen: set[str] = set()

        def each_gateway_used_it() -> bool:  # a job of each gateway's own on the spare
            for name in set(GATEWAYS) - seen:
                row = [w for w in cluster.gateways[name].workers() if w["id"] == spare.worker_id]
                if row and (row[0]["in_flight"] or (row[0]["load"] or {}).get("yours")):
                    seen.add(name)
            return seen == set(GATEWAYS)

        wait_until(each_gateway_used_it, f"every gateway to serve requests on {spare.worker_id}", poll_s=0.05)
    finally:
        report = reported(load.stop())
    assert not report.of(FAILED), report  # etcd's outage costs no request
    assert f"worker {spare.worker_id} registered in etcd" in cluster.worker_log(spare)


def test_the_leader_killed_during_an_on_demand_load(cluster: HaCluster) -> None:
    """A request for an on-demand model waits at a survivor; the leader claims the load, sends Load
    to the model's standby worker and is SIGKILLed while the (slow) load is in flight."""
    etcd_of(cluster)
    cluster.heal()
    lazy = cluster.lazy
    if not cluster.running(lazy):
        cluster.start_worker(lazy)
    cluster.wait_ready_everywhere(lazy, state="unloaded")  # it stands by without its model
    loads_before = cluster.worker_log(lazy).count(LOADED)
    leaders = wait_until(lambda: [n for n in GATEWAYS if cluster.gateways[n].leads()] or None,
                         "a gateway to lead the cluster", 30)  # fmt: skip
    assert len(leaders) == 1, leaders
    leader, survivors = leaders[0], [n for n in GATEWAYS if n != leaders[0]]
    answers: list[int] = []

    def the_leader() -> str | None:
        return next((n for n in survivors if cluster.gateways[n].leads()), None)

    def ask() -> None:
        answers.append(direct_completion(cluster.gateways[survivors[0]], LOAD_KEY, LAZY_MODEL, timeout=120))

    asking = threading.Thread(target=ask, name="ask-lazy")
    load = steady_load(cluster, "leader killed")
    try:
        wait_until(lambda: load.streaming_via(leader), f"a stream through {leader}", poll_s=0.05)
        asking.start()
        wait_until(lambda: cluster.worker_log(lazy).count(LOADED) > loads_before,
                   f"{lazy.worker_id} to begin loading", 30, poll_s=0.05,
                   context=lambda: cluster.gateway_log(leader)[-3000:])  # fmt: skip
        killed_at = time.monotonic()
        cluster.kill_gateway(leader)
        new_leader = wait_until(the_leader, "a surviving gateway to lead", LEADER_TTL_S + 10, poll_s=0.05)
        took_over_s = time.monotonic() - killed_at
        asking.join(120)
        for name in survivors:
            wait_until(lambda g=cluster.gateways[name]: g.worker_state(lazy.worker_id) == "ready",
                       f"{lazy.worker_id} ready in {name}", 60)  # fmt: skip
        wait_until(lambda: load.finished_after(killed_at) >= CONCURRENCY, "the load to go on")
    finally:
        report = reported(load.stop())
    print(f"{new_leader} took over from {leader} {took_over_s:.2f} s after the kill; answers: {answers}")
    assert took_over_s < LEADER_TTL_S + TAKEOVER_MARGIN_S, took_over_s
    assert answers == [200], answers  # the request that waited for the load is served
    # Exactly once: one load in the worker, decided by the killed leader alone.
    assert cluster.worker_log(lazy).count(LOADED) == loads_before + 1, cluster.worker_log(lazy)[-3000:]
    decided = [n for n in GATEWAYS if f"decided: load {lazy.worker_id}" in cluster.gateway_log(n)]
    assert decided == [leader], decided
    # Only the killed leader's requests fail.
    servers = cluster.haproxy.servers_by_request()
    for record in report.of(FAILED):
        assert servers.get(record.rid) == leader and record.ended_after(killed_at), (record, report)
