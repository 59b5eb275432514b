"""`watcher agent`: the node agent finds real torchrun jobs it never launched,
records them with real eBPF programs, serves Prometheus metrics over HTTP,
keeps the recording of a job whose rank was killed, bounds its ring, survives
its own SIGKILL, and exports Parquet that `watcher sql` reads as one fleet.

The jobs are tests/workloads/steady.py: STEPS all_reduce calls per rank, one
every ~STEP_S seconds (the ground truth the metrics and recordings are
checked against)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .conftest import ROOT, needs_bpf, query, watcher

pytestmark = needs_bpf

STEP_S = 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class AgentProc:
    def __init__(self, tmp: Path, name: str, *args: str, token: str | None = None):
        self.token = token
        if token:
            args = (*args, "--token", token)
        self.port = _free_port()
        self.root = tmp / f"{name}-root"
        self.log = tmp / f"{name}.log"
        self.args = ["agent", "--root", str(self.root), "--listen", f"127.0.0.1:{self.port}", "--node", name,
                     *args]
        self.proc = None

    def start(self) -> "AgentProc":
        self.proc = subprocess.Popen([sys.executable, "-m", "watcher.cli", *self.args], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "a"))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"agent exited {self.proc.returncode}: {self.log.read_text()}"
            try:
                self.metrics_text()
                return self
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"agent never served metrics: {self.log.read_text()}")

    def probed_ahead(self, timeout: float = 120) -> "AgentProc":
        """Wait for the agent's attach to its own environment's libtorch (done
        once at start, off its recording loop): from then on a job's every
        collective is seen, however soon it makes it."""
        _wait(lambda: re.search(r"attached \d+ libtorch probes", self.log.read_text()), timeout,
              "libtorch probed ahead", step=0.2)
        return self

    def get(self, path: str, token: str | None = None) -> bytes:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}")
        if token or self.token:
            req.add_header("Authorization", f"Bearer {token or self.token}")
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.read()

    def metrics_text(self) -> str:
        return self.get("/metrics").decode()

    def metrics(self) -> dict:
        """{(name, frozenset(labels)): value}, parsed by Prometheus's own parser."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for fam in text_string_to_metric_families(self.metrics_text()):
            for s in fam.samples:
                out[(s.name, frozenset(s.labels.items()))] = s.value
        return out

    def jobs(self) -> list[dict]:
        return json.loads(self.get("/jobs"))

    def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _job(tmp: Path, tag: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(ROOT / "tests/workloads/steady.py"), "--tag", tag, "--step-s", str(STEP_S), *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _ranks_of(launcher: int) -> dict[int, int]:
    """{rank: pid} of the launcher's workers, from /proc (the test's own view)."""
    out = {}
    try:
        kids = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    except OSError:
        return out
    for pid in map(int, kids):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode(
                errors="replace").split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = pid
    return out


def _wait(cond, timeout: float, what: str, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _agent_job(agent: AgentProc, launcher: int) -> dict | None:
    return next((j for j in agent.jobs() if j["pid"] == launcher), None)


def _kept(agent: AgentProc, job_id: str) -> list[Path]:
    return sorted((agent.root / job_id).glob("*.duckdb"))


def test_agent_finds_records_and_keeps_a_killed_job(tmp_path):
    agent = AgentProc(tmp_path, "nodeA", "--match", "agent1", "--keep-all", "--ring-minutes", "5",
                      "--parquet", str(tmp_path / "tree")).start().probed_ahead()
    jobs = []
    try:
        until = [tmp_path / "a.go", tmp_path / "b.go"]
        for f in until:
            jobs.append(_job(tmp_path, "agent1", "--steps", "0", "--until", str(f)))
        started = time.monotonic()
        # Both jobs found within 2 s of their launch, with no change to them.
        found = {}
        for j in jobs:
            found[j.pid] = _wait(lambda: _agent_job(agent, j.pid), 2.0, f"job {j.pid} in /jobs")
        assert time.monotonic() - started <= 2.5
        # Their ranks within 2 s of existing (the test sees them in /proc).
        for j in jobs:
            ranks = _wait(lambda: len(_ranks_of(j.pid)) == 2 and _ranks_of(j.pid), 60, "the workers")
            seen = time.monotonic()
            got = _wait(lambda: {r["rank"]: r["pid"] for r in _agent_job(agent, j.pid)["ranks"]} == ranks, 2.0,
                        f"ranks {ranks} of job {j.pid} in /jobs", step=0.02)
            assert got and time.monotonic() - seen <= 2.0
        ids = [found[j.pid]["id"] for j in jobs]
        # Training under way: every rank's collectives counted.
        def calls(job_id, rank, m=None):
            m = m or agent.metrics()
            return m.get(("watcher_rank_collectives_total",
                          frozenset({"node": "nodeA", "job": job_id, "rank": str(rank)}.items())), 0)
        _wait(lambda: all(calls(i, r) >= 30 for i in ids for r in (0, 1)), 90, "30 collectives a rank", step=0.5)
        m = agent.metrics()
        for i in ids:
            lab = frozenset({"node": "nodeA", "job": i}.items())
            assert m[("watcher_job_up", frozenset(dict(lab, launcher_pid=str(_pid(jobs, ids, i)),
                                                        run_id=_run_id(agent, i)).items()))] == 1
            assert m[("watcher_job_ranks", lab)] == 2
            for r in (0, 1):
                rl = frozenset({"node": "nodeA", "job": i, "rank": str(r)}.items())
                # A step is a STEP_S sleep and one all_reduce: the estimate from outside is near it.
                assert STEP_S * 0.9 <= m[("watcher_rank_step_seconds", rl)] <= STEP_S * 2, m
                assert m[("watcher_rank_syscalls_total", rl)] > 0
                assert ("watcher_rank_collective_seconds", frozenset(dict(rl, quantile="0.99").items())) in m
        assert m[("watcher_agent_dropped_events_total", frozenset())] == 0
        assert 0 < m[("watcher_agent_memory_bytes", frozenset())]
        # Kill rank 1 of job B from outside.
        victim = _ranks_of(jobs[1].pid)[1]
        os.kill(victim, signal.SIGKILL)
        jobs[1].wait(60)
        kept_b = _wait(lambda: _kept(agent, ids[1]), 30, "job B's kept recording")
        assert kept_b[0].name.endswith("-crash-rank1.duckdb"), kept_b
        rep = watcher("analyze", "crash", str(kept_b[0]), "--format", "json", check=True)
        crash = json.loads(rep.stdout)
        assert crash["first_dead_rank"] == 1 and crash["crashed"]["1"]["exit_signal"] == 9, crash
        assert crash["crashed"]["1"]["pid"] == victim
        # Job A went on, untouched; it ends well and (--keep-all) is kept at its end.
        assert jobs[0].poll() is None
        until[0].touch()
        out, _ = jobs[0].communicate(timeout=60)
        assert jobs[0].returncode == 0, out
        steps = {int(r): int(n) for r, n in re.findall(r"rank (\d+) steps (\d+)", out)}
        assert set(steps) == {0, 1}, out
        kept_a = _wait(lambda: _kept(agent, ids[0]), 30, "job A's kept recording")
        assert kept_a[0].name.endswith("-ended.duckdb")
        # Every all_reduce of every rank is in it (the ring covers the whole job).
        got = dict(query(kept_a[0], "SELECT rank, count(*) FROM collective WHERE op = 'allreduce' GROUP BY rank"))
        assert got == steps
        assert dict(query(kept_a[0], "SELECT key, value FROM meta"))["agent_job"] == ids[0]
        # Only job A's processes in A's recording.
        pids = {r[0] for r in query(kept_a[0], "SELECT pid FROM process")}
        assert jobs[0].pid in pids and victim not in pids and jobs[1].pid not in pids
        # The job ended: the metrics say so.
        _wait(lambda: agent.metrics().get(("watcher_job_up", frozenset(dict(
            node="nodeA", job=ids[0], launcher_pid=str(jobs[0].pid), run_id=_run_id(agent, ids[0])).items()))) == 0,
            5, "job A down in the metrics", step=0.2)
        # The same rows in the Parquet tree, read by `watcher sql`.
        res = watcher("sql", str(tmp_path / "tree"), "SELECT job, rank, count(*) FROM collective "
                      "WHERE op = 'allreduce' AND node = 'nodeA' GROUP BY ALL ORDER BY ALL", "--format", "json",
                      check=True)
        tree = {(r["job"], r["rank"]): r["count_star()"] for r in json.loads(res.stdout)}
        assert {(ids[0], r): n for r, n in steps.items()}.items() <= tree.items()
    finally:
        for j in jobs:
            if j.poll() is None:
                j.kill()
        for f in (tmp_path / "a.go", tmp_path / "b.go"):
            f.touch()
        assert agent.stop() == 0, agent.log.read_text()


def _pid(jobs, ids, job_id) -> int:
    return jobs[ids.index(job_id)].pid


def _run_id(agent: AgentProc, job_id: str) -> str:
    return next(j for j in agent.jobs() if j["id"] == job_id)["run_id"] or ""


def test_ring_bounds_and_an_agent_killed_and_restarted(tmp_path):
    ring_s = 6.0
    agent = AgentProc(tmp_path, "nodeR", "--match", "agent2", "--ring-minutes", str(ring_s / 60)).start()
    go = tmp_path / "go"
    # ~1 MB of events a second: 100 steps a second.
    job = _job(tmp_path, "agent2", "--steps", "0", "--until", str(go), "--step-s", "0.01")
    try:
        info = _wait(lambda: _agent_job(agent, job.pid), 2.0, "the job")
        _wait(lambda: len(_ranks_of(job.pid)) == 2, 60, "the workers")
        time.sleep(2 * ring_s)  # run well past the ring
        # Keep it on request: only the last ring_s seconds (plus a flush) are in it.
        req = urllib.request.Request(f"http://127.0.0.1:{agent.port}/keep?job={info['id']}", method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 202
        kept = _wait(lambda: _kept(agent, info["id"]), 10, "the kept recording")[0]
        lo, hi = query(kept, "SELECT min(ts), max(ts) FROM syscall")[0]
        end = int(dict(query(kept, "SELECT key, value FROM meta"))["end_ts"])
        assert lo >= end - (ring_s + 2.5) * 1e9, (lo, end)
        assert hi > end - 2e9  # and it is recent
        assert query(kept, "SELECT count(*) FROM prune")[0][0] > 0  # what was dropped is said
        # An agent killed outright leaves its kept recordings readable...
        agent.stop(signal.SIGKILL)
        res = watcher("sql", str(kept), "SELECT count(*) AS n FROM process WHERE rank IS NOT NULL",
                      "--format", "csv", check=True)
        assert res.stdout.splitlines()[1] == "2"
        assert not list(agent.root.rglob("*.partial"))
        # ...and the job runs on; a new agent, with a size cap on its ring this
        # time, picks it up again at its first look.
        assert job.poll() is None
        cap = 5 << 20
        agent.args += ["--ring-minutes", "1", "--ring-max-size", str(cap)]
        agent.start()
        again = _wait(lambda: _agent_job(agent, job.pid), 2.0, "the job, found again")
        assert again["id"] == info["id"]
        _wait(lambda: len(_agent_job(agent, job.pid)["ranks"]) == 2, 3.0, "its ranks, found again")
        # The ring's size stays under the cap at every look (~1 MB/s for 15 s).
        sizes = []
        for _ in range(30):
            sizes.append(agent.metrics()[("watcher_agent_ring_bytes", frozenset())])
            time.sleep(0.5)
        assert max(sizes) <= cap, sizes
        assert agent.metrics()[("watcher_agent_events_total", frozenset())] > 50_000
        go.touch()
        assert job.wait(60) == 0
    finally:
        go.touch()
        if job.poll() is None:
            job.kill()
        agent.stop()


def test_fleet_sql_over_two_agents_parquet(tmp_path):
    tree = tmp_path / "fleet"
    agents = [AgentProc(tmp_path, f"node{i}", "--match", f"fleet{i}", "--keep-all", "--parquet", str(tree))
              for i in (0, 1)]
    jobs = []
    try:
        for a in agents:
            a.start().probed_ahead()
        steps = {0: 20, 1: 30}
        jobs = [_job(tmp_path, f"fleet{i}", "--steps", str(steps[i])) for i in (0, 1)]
        for j in jobs:
            assert j.wait(120) == 0, j.stdout.read()
        for i, a in enumerate(agents):
            _wait(lambda: any(a.root.glob("*/*.duckdb")), 30, f"node{i}'s kept recording")
        # One query over both agents' files: all_reduce calls by node and rank.
        res = watcher("sql", str(tree), "SELECT node, rank, count(*) AS n FROM collective "
                      "WHERE op = 'allreduce' GROUP BY ALL ORDER BY ALL", "--format", "json", check=True)
        got = {(r["node"], r["rank"]): r["n"] for r in json.loads(res.stdout)}
        assert got == {(f"node{i}", r): steps[i] for i in (0, 1) for r in (0, 1)}, got
        # A cross-node join: each node's rank 0 against the other's, by job.
        res = watcher("sql", str(tree), "SELECT count(DISTINCT node), count(DISTINCT job) FROM process "
                      "WHERE rank = 0", "--format", "csv", check=True)
        assert res.stdout.splitlines()[1] == "2,2"
    finally:
        for j in jobs:
            if j.poll() is None:
                j.kill()
        for a in agents:
            a.stop()


def test_agent_refuses_bad_options(tmp_path):
    r = watcher("agent", "--root", str(tmp_path / "r"), "--listen", "0.0.0.0:9999")
    assert r.returncode == 2 and "--token" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = watcher("agent", "--root", str(tmp_path / "r"), "--listen", "nonsense")
    assert r.returncode == 2 and "HOST:PORT" in r.stderr
    r = watcher("agent", "--root", str(tmp_path / "r"), "--ring-minutes", "0")
    assert r.returncode == 2 and "--ring-minutes" in r.stderr


def test_deployment_files_grant_the_same_privileges():
    """The systemd unit and the DaemonSet grant the agent the same capabilities,
    and the DaemonSet sees the node's processes (hostPID) and requires a token
    off loopback."""
    import yaml

    docs = list(yaml.safe_load_all((ROOT / "deploy/watcher-agent-daemonset.yaml").read_text()))
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    c = pod["containers"][0]
    caps = set(c["securityContext"]["capabilities"]["add"])
    assert "agent" == c["args"][0] and any(a.startswith("--listen=0.0.0.0") for a in c["args"])
    assert any(e["name"] == "WATCHER_AGENT_TOKEN" for e in c["env"])
    unit = (ROOT / "deploy/watcher-agent.service").read_text()
    ambient = next(line for line in unit.splitlines() if line.startswith("AmbientCapabilities="))
    assert {x.removeprefix("CAP_") for x in ambient.split("=", 1)[1].split()} == caps


def test_a_hang_seen_from_outside_is_kept_and_node_health_is_in_the_metrics(tmp_path):
    from watcher import health

    ledger = health.Ledger(None, tmp_path / "health")
    ledger.add({"kind": "failure", "device": "cpu1@nodeH", "incident_id": "inc-0001", "run": "r1"})
    assert ledger.quarantine("cpu1@nodeH", "3 failures", "inc-0001", "r1")["quarantined"]
    agent = AgentProc(tmp_path, "nodeH", "--match", "agent4", "--hang-seconds", "3",
                      "--health-dir", str(tmp_path / "health"), token="s3cret").start()
    # With a token, a request without it (or with another) gets nothing.
    import urllib.error
    for bad in (None, "wrong"):
        req = urllib.request.Request(f"http://127.0.0.1:{agent.port}/metrics")
        if bad:
            req.add_header("Authorization", f"Bearer {bad}")
        try:
            urllib.request.urlopen(req, timeout=5)
            raise AssertionError("served without the token")
        except urllib.error.HTTPError as e:
            assert e.code == 401
    job = _job(tmp_path, "agent4", "--steps", "100000", "--hang-rank", "1", "--hang-at", "40")
    try:
        m = agent.metrics()
        dev = frozenset({"node": "nodeH", "device": "cpu1@nodeH"}.items())
        assert m[("watcher_node_device_quarantined", dev)] == 1 and m[("watcher_node_device_failures", dev)] == 1
        assert m[("watcher_node_unusable", frozenset())] == 0
        info = _wait(lambda: _agent_job(agent, job.pid), 2.0, "the job")
        kept = _wait(lambda: _kept(agent, info["id"]), 90, "the hang's kept recording", step=0.5)
        assert kept[0].name.endswith("-hang.duckdb"), kept
        assert job.poll() is None  # kept from outside: the job is not touched
        assert _agent_job(agent, job.pid)["incidents"] == {"hang": 1}
        rep = json.loads(watcher("analyze", "hang", str(kept[0]), "--format", "json", check=True).stdout)
        assert rep["suspect_ranks"] == [1], rep
        # Rank 0 made 41 all_reduce calls (steps 0..40), rank 1 stopped before its 41st.
        got = dict(query(kept[0], "SELECT rank, count(*) FROM collective WHERE op = 'allreduce' GROUP BY rank"))
        assert got == {0: 41, 1: 40}, got
    finally:
        for pid in _ranks_of(job.pid).values():
            os.kill(pid, signal.SIGKILL)
        job.kill()
        job.wait(30)
        agent.stop()


def test_ranks_a_scheduler_started_one_by_one_are_one_job(tmp_path):
    """As srun does: each rank started on its own (no launcher), with RANK,
    WORLD_SIZE, MASTER_ADDR and the scheduler's job id in its environment."""
    agent = AgentProc(tmp_path, "nodeS", "--match", "agent5", "--keep-all").start().probed_ahead()
    port = _free_port()
    ranks = []
    try:
        for r in (0, 1):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), SLURM_JOB_ID="77001")
            ranks.append(subprocess.Popen([sys.executable, str(ROOT / "tests/workloads/steady.py"), "--tag",
                                           "agent5", "--steps", "60", "--step-s", str(STEP_S)],
                                          cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
        job = _wait(lambda: next((j for j in agent.jobs() if len(j["ranks"]) == 2), None), 30, "one job, 2 ranks")
        assert job["id"].startswith("77001-") and job["run_id"] == "77001", job
        assert {r["rank"]: r["pid"] for r in job["ranks"]} == {0: ranks[0].pid, 1: ranks[1].pid}
        assert len(agent.jobs()) == 1
        for p in ranks:
            assert p.wait(120) == 0
        kept = _wait(lambda: _kept(agent, job["id"]), 30, "the kept recording")
        assert len(kept) == 1 and kept[0].name.endswith("-ended.duckdb")
        got = dict(query(kept[0], "SELECT rank, count(*) FROM collective WHERE op = 'allreduce' GROUP BY rank"))
        assert got == {0: 60, 1: 60}, got
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
        agent.stop()
