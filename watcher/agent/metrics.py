"""The agent's numbers: computed once a flush from the ring, served to Prometheus.

The recording loop computes a snapshot (plain dicts) after each flush; the
HTTP thread only turns the latest snapshot into the text format, so a scrape
never touches the database or waits for the recorder.

Step time comes from the outside: no code runs in the job.  A rank's
collectives come in bursts, one burst a step (DDP's buckets, an optimizer's
all_reduce); a burst starts where the gap since the previous call is over 4
times the median gap.  The step time is the median time between burst
starts over the last minute, or the median gap when every gap is alike (one
collective a step).
"""

from __future__ import annotations

import hmac
import json
import resource
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import numpy as np

WINDOW_NS = 60 * 10**9   # step time and latency percentiles: the last minute
QUANTILES = (0.5, 0.9, 0.99)


def step_time_s(ts: list[int]) -> float | None:
    """Seconds per step from one rank's collective entry times (sorted, ns)."""
    if len(ts) < 3:
        return None
    t = np.asarray(ts, dtype=np.int64)
    gaps = np.diff(t)
    med = float(np.median(gaps))
    starts = t[1:][gaps > 4 * med]
    if len(starts) >= 3:
        return float(np.median(np.diff(starts))) / 1e9
    return med / 1e9


def rank_numbers(con, since_ns: int) -> dict[int, dict]:
    """Per traced process: collectives (count, latency percentiles, last call,
    step time) over the window, and its exact syscall and futex totals."""
    out: dict[int, dict] = {}
    for upid, n, q, last, ts in con.execute(
            "SELECT upid, count(*), quantile_cont(dur, ?), max(ts), list(ts ORDER BY ts) "
            "FROM collective WHERE ts >= ? GROUP BY upid", [list(QUANTILES), since_ns]).fetchall():
        out[upid] = {"window_collectives": n, "latency_s": [x / 1e9 for x in q], "last_collective_ts": last,
                     "step_s": step_time_s(ts)}
    for upid, n, dur, fut in con.execute(
            "SELECT upid, sum(count), sum(dur_total), sum(dur_total) FILTER (WHERE name = 'futex') "
            "FROM syscall_stat GROUP BY upid").fetchall():
        d = out.setdefault(upid, {})
        d.update(syscalls=int(n or 0), syscall_s=(dur or 0) / 1e9, futex_s=(fut or 0) / 1e9)
    return out


def collective_counts(con, after_id: int) -> tuple[dict[int, int], dict[int, int], int]:
    """New collectives per process since row `after_id` (a running total
    that the ring's pruning cannot take back), the entry time of each one's
    latest, and the new high mark."""
    rows = con.execute("SELECT upid, count(*), max(ts), max(api_call_id) FROM collective "
                       "WHERE api_call_id > ? GROUP BY upid", [after_id]).fetchall()
    return ({u: n for u, n, _, _ in rows}, {u: t for u, _, t, _ in rows},
            max([after_id] + [m for _, _, _, m in rows]))


def self_usage() -> dict:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    rss = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"cpu_s": ru.ru_utime + ru.ru_stime, "rss_bytes": rss}


class SnapshotCollector:
    """A prometheus_client collector over the agent's latest snapshot."""

    def __init__(self):
        self.snapshot: dict = {"jobs": [], "agent": {}}

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self.snapshot  # replaced whole by the loop: read once
        a = snap.get("agent", {})
        node = a.get("node", "")
        g = GaugeMetricFamily
        c = CounterMetricFamily
        yield c("watcher_agent_cpu_seconds", "CPU time of the agent process.", value=a.get("cpu_s", 0))
        yield g("watcher_agent_memory_bytes", "Resident memory of the agent process.", value=a.get("rss_bytes", 0))
        yield g("watcher_agent_ring_bytes", "Bytes the in-memory ring holds.", value=a.get("ring_bytes", 0))
        yield g("watcher_agent_ring_span_seconds", "Time the ring covers now.", value=a.get("ring_span_s", 0))
        yield c("watcher_agent_events", "Events recorded on the node.", value=a.get("events", 0))
        yield c("watcher_agent_dropped_events", "Events the kernel could not queue (rings full); never silent.",
                value=a.get("drops", 0))
        yield g("watcher_agent_jobs_running", "Training jobs being recorded now.",
                value=sum(1 for j in snap.get("jobs", []) if j["state"] == "running"))
        up = g("watcher_job_up", "1 while the job runs, 0 once it ended (kept in the metrics for a while).",
               labels=["node", "job", "launcher_pid", "run_id"])
        ranks = g("watcher_job_ranks", "Ranks of the job seen on this node.", labels=["node", "job"])
        inc = c("watcher_job_incidents", "Incidents the agent saw from outside, by kind.",
                labels=["node", "job", "kind"])
        kept = c("watcher_job_recordings_kept", "Recordings kept for the job.", labels=["node", "job"])
        info = g("watcher_rank_info", "A rank's process (1 while alive).", labels=["node", "job", "rank", "pid"])
        step = g("watcher_rank_step_seconds", "Time per step over the last minute (from its collectives).",
                 labels=["node", "job", "rank"])
        lat = g("watcher_rank_collective_seconds", "Collective call latency over the last minute, by quantile.",
                labels=["node", "job", "rank", "quantile"])
        colls = c("watcher_rank_collectives", "Collective calls.", labels=["node", "job", "rank"])
        age = g("watcher_rank_last_collective_age_seconds", "Seconds since the rank's last collective call.",
                labels=["node", "job", "rank"])
        sysc = c("watcher_rank_syscalls", "System calls (exact kernel counts).", labels=["node", "job", "rank"])
        syss = c("watcher_rank_syscall_seconds", "Time inside system calls.", labels=["node", "job", "rank"])
        fut = c("watcher_rank_futex_wait_seconds", "Time inside futex calls (lock and condition waits).",
                labels=["node", "job", "rank"])
        for j in snap.get("jobs", []):
            jl = [node, j["id"]]
            up.add_metric(jl + [str(j["pid"]), j.get("run_id") or ""], 1 if j["state"] == "running" else 0)
            ranks.add_metric(jl, len(j["ranks"]))
            kept.add_metric(jl, len(j.get("kept", [])))
            for kind, n in sorted(j.get("incidents", {}).items()):
                inc.add_metric(jl + [kind], n)
            for r in j["ranks"]:
                rl = jl + [str(r["rank"])]
                info.add_metric(rl + [str(r["pid"])], 1 if r["alive"] else 0)
                colls.add_metric(rl, r.get("collectives", 0))
                if r.get("step_s") is not None:
                    step.add_metric(rl, r["step_s"])
                for q, v in zip(QUANTILES, r.get("latency_s") or []):
                    lat.add_metric(rl + [str(q)], v)
                if r.get("last_collective_age_s") is not None:
                    age.add_metric(rl, r["last_collective_age_s"])
                sysc.add_metric(rl, r.get("syscalls", 0))
                syss.add_metric(rl, r.get("syscall_s", 0.0))
                fut.add_metric(rl, r.get("futex_s", 0.0))
        yield from (up, ranks, inc, kept, info, step, lat, colls, age, sysc, syss, fut)
        yield from _health_metrics(snap.get("health") or {}, node)


def _health_metrics(h: dict, node: str):
    """The node's device ledger and NVML counters (watcher/health.py)."""
    from prometheus_client.core import GaugeMetricFamily as g

    fails = g("watcher_node_device_failures", "Failures pinned on the device in the node's health ledger.",
              labels=["node", "device"])
    quar = g("watcher_node_device_quarantined", "1 while the device is quarantined.", labels=["node", "device"])
    for name, d in sorted((h.get("devices") or {}).items()):
        fails.add_metric([node, name], d["failures"])
        quar.add_metric([node, name], 1 if d["quarantined"] else 0)
    yield fails
    yield quar
    yield g("watcher_node_unusable", "1 when the health breaker marked the node unusable.",
            value=1 if h.get("unusable") else 0)
    gpu = g("watcher_gpu_counter", "NVML health counters per GPU (ECC, remapped rows, retired pages, "
            "throttle reasons, PCIe replays, NVLink errors, temperature).", labels=["node", "gpu", "uuid", "counter"])
    for d in h.get("gpus") or []:
        for k, v in d.items():
            if k not in ("index", "uuid", "name") and isinstance(v, (int, float)) and not isinstance(v, bool):
                gpu.add_metric([node, str(d["index"]), d["uuid"], k], v)
    yield gpu


class MetricsServer:
    """GET /metrics (Prometheus text), GET /jobs (JSON), POST /keep[?job=ID].

    With a token, every request needs `Authorization: Bearer TOKEN`."""

    def __init__(self, host: str, port: int, collector: SnapshotCollector, on_keep, token: str | None = None):
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.collector = collector
        self.on_keep = on_keep
        self.token = token
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # the agent's log is for what matters
                pass

            def _authorized(self) -> bool:
                if server.token is None:
                    return True
                got = self.headers.get("Authorization", "")
                return hmac.compare_digest(got.encode(), f"Bearer {server.token}".encode())

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if not self._authorized():
                    return self._send(401, b"token required\n", "text/plain")
                path = urlparse(self.path).path
                if path == "/metrics":
                    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
                    return self._send(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
                if path == "/jobs":
                    return self._send(200, json.dumps(server.collector.snapshot.get("jobs", []),
                                                      default=str).encode(), "application/json")
                self._send(404, b"try /metrics or /jobs\n", "text/plain")

            def do_POST(self):
                if not self._authorized():
                    return self._send(401, b"token required\n", "text/plain")
                url = urlparse(self.path)
                if url.path != "/keep":
                    return self._send(404, b"try POST /keep?job=ID\n", "text/plain")
                job = (parse_qs(url.query).get("job") or [None])[0]
                ok, msg = server.on_keep(job)
                self._send(202 if ok else 404, json.dumps({"ok": ok, "message": msg}).encode(),
                           "application/json")

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="watcher-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)

