"""The device health ledger: per device, the health signals read from it and
every failure pinned on it, so that a device that keeps failing is taken out
of use even when each failure, replayed, came back clean.

A device is a GPU (by NVML UUID, `gpu-<uuid>`) or, on a CPU job, one core of a
host (`cpu<N>@<host>`): the core a rank's training thread ended the failing
step on (every step line of the steps log carries it as "cpu").

Where it is kept:

    DIR/health.jsonl         this run's events; the recording's `health_event` table
    NODE/ledger.jsonl        with `watcher run --health-dir NODE`: every run's events on the node,
                             so that recurrence counts across jobs (a fleet keeps one NODE per host)
    NODE/quarantined.json     the node's quarantined devices, for the next launch
    NODE/unusable.json       the breaker tripped: the node itself is suspect

Events: `failure` (an incident pinned on the device: a transient divergence
localised to the rank that ran there, an SDC found by the audit, a hardware
attribution), `quarantine` (the device was taken out of use, or would have
been under --policy apply), `signal` (NVML counters and EDAC memory error
counts read at the run's start and end; `bad` when past a threshold below).

| rule      | what it does                                                                   | default |
|-----------|--------------------------------------------------------------------------------|---------|
| repeat    | the Nth failure on one device within W seconds (this run and, with --health-dir, every earlier run on the node) is attributed to the device: hardware, quarantine_device, even when each single failure replayed clean | N=3, W=7 days |
| breaker   | never more than this share of a node's devices quarantined (at least one): past it the node is marked unusable instead | 25% |
| NVML      | a bad signal counts as a failure: volatile uncorrected ECC errors, pending page retirement or a row-remap failure, a critical XID (48, 63, 64, 74, 79, 92, 94, 95), entered as the driver raises it (XidListener) | on |
| EDAC      | uncorrected memory errors rising during the run count as a failure of every core of the host | on |

`watcher health` prints a node's (or a run's) ledger and quarantine list and,
with --gate, exits 8 when the node is unusable (a Slurm prolog or a Kubernetes
init container reads that); `watcher check` prints what NVML says.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .rundir import RunDir, read_json, write_json

NODE_DIR_ENV = "WATCHER_HEALTH_DIR"
CRITICAL_XIDS = (48, 63, 64, 74, 79, 92, 94, 95)


@dataclass
class HealthRules:
    repeat_limit: int = 3
    repeat_window_s: float = 7 * 86400.0
    max_quarantine_share: float = 0.25


RULES = HealthRules()

_libc = None


def cpu_now() -> int | None:
    """The core this thread runs on (sched_getcpu: a vDSO read, well under a microsecond)."""
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        n = _libc.sched_getcpu()
        return n if n >= 0 else None
    except (OSError, AttributeError):
        return None


def cpu_device(cpu: int, host: str | None = None) -> str:
    return f"cpu{cpu}@{host or os.uname().nodename}"


def parse_cpu_device(device: str) -> tuple[int, str] | None:
    if not device.startswith("cpu") or "@" not in device:
        return None
    core, host = device[3:].split("@", 1)
    return (int(core), host) if core.isdigit() else None


def node_cpus() -> list[int]:
    """The cores this node lets its jobs use."""
    return sorted(os.sched_getaffinity(0))


class Ledger:
    """The run's ledger (always) and the node's (with a health directory)."""

    def __init__(self, run_root: Path | None, node_dir: Path | None = None):
        self.run_file = RunDir(run_root).health_log if run_root is not None else None
        self.node_dir = Path(node_dir) if node_dir else None
        if self.node_dir is not None:
            self.node_dir.mkdir(parents=True, exist_ok=True)

    @classmethod
    def for_run(cls, run_root: Path) -> "Ledger":
        return cls(run_root, os.environ.get(NODE_DIR_ENV) or None)

    @property
    def node_file(self) -> Path | None:
        return self.node_dir / "ledger.jsonl" if self.node_dir else None

    @property
    def quarantine_file(self) -> Path | None:
        return self.node_dir / "quarantined.json" if self.node_dir else None

    @property
    def unusable_file(self) -> Path | None:
        return self.node_dir / "unusable.json" if self.node_dir else None

    # -- writing -----------------------------------------------------------------------------
    def add(self, event: dict) -> dict:
        event = dict(event, ts=event.get("ts") or time.time())
        line = json.dumps(event, default=str) + "\n"
        for path in (self.run_file, self.node_file):
            if path is None:
                continue
            # One write of one line under an exclusive lock: runs on one node share the file.
            with open(path, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX)
                f.write(line)
        return event

    def breaker(self, device: str) -> str | None:
        """Why quarantining `device` would take too much of the node out of use, or None."""
        held = self.quarantined()
        if device in held:
            return None
        total = self.devices_on_node(device)
        cap = max(1, int(RULES.max_quarantine_share * total))
        if len(held) + 1 <= cap:
            return None
        return (f"breaker: {len(held)} of {total} devices of this node are quarantined already (at most {cap}); "
                f"{device} failing too makes the node suspect, not the device")

    def quarantine(self, device: str, reason: str, incident_id: str | None, run: str | None) -> dict:
        """Take `device` out of use on the node, unless the breaker says the node itself is suspect."""
        if device in self.quarantined():
            return {"quarantined": True, "already": True}
        refused = self.breaker(device)
        if refused:
            self.add({"kind": "quarantine", "device": device, "incident_id": incident_id, "run": run,
                      "detail": {"refused": refused}})
            if self.unusable_file is not None:
                write_json(self.unusable_file, {"reason": refused, "device": device, "incident_id": incident_id,
                                                "ts": time.time()})
            return {"quarantined": False, "breaker": refused}
        entry = {"device": device, "reason": reason, "incident_id": incident_id, "run": run, "ts": time.time()}
        if self.quarantine_file is not None:
            write_json(self.quarantine_file, held_list(self.quarantine_file) + [entry])
        self.add({"kind": "quarantine", "device": device, "incident_id": incident_id, "run": run,
                  "detail": {"reason": reason}})
        return {"quarantined": True}

    # -- reading -----------------------------------------------------------------------------
    def events(self) -> list[dict]:
        """Every event: the node's ledger when there is one (it holds this run's too), else the run's."""
        path = self.node_file if self.node_file is not None else self.run_file
        return read_events(path) if path is not None else []

    def failures(self, device: str, now: float | None = None) -> list[dict]:
        """Failures on `device` within the repeat window."""
        now = now or time.time()
        return [e for e in self.events() if e.get("device") == device and e.get("kind") == "failure"
                and now - e.get("ts", 0) <= RULES.repeat_window_s]

    def quarantined(self) -> list[str]:
        if self.quarantine_file is not None:
            return [q["device"] for q in held_list(self.quarantine_file)]
        return sorted({e["device"] for e in self.events() if e.get("kind") == "quarantine"
                       and not (e.get("detail") or {}).get("refused")})

    @staticmethod
    def devices_on_node(device: str) -> int:
        if parse_cpu_device(device):
            return len(node_cpus())
        return max(1, len(nvml_devices() or []))


def visible_gpus(quarantined: list[str], gpus: list[dict] | None, visible: str | None) -> tuple[str | None, list[str]]:
    """CUDA_VISIBLE_DEVICES for a launch that leaves the quarantined GPUs out.

    `gpus`: NVML's list (index, uuid); `visible`: the launch's own
    CUDA_VISIBLE_DEVICES (indices or UUIDs), if set.  Returns (the value to
    set, or None to leave it as it is; the UUIDs left out).  UUIDs, not
    indices: they name the same board whatever the enumeration order."""
    bad = {q.removeprefix("gpu-") for q in quarantined if q.startswith("gpu-")}
    if not bad or not gpus:
        return None, []
    by_index = {str(d["index"]): d["uuid"] for d in gpus}
    wanted = [d["uuid"] for d in gpus] if visible is None else \
        [by_index.get(v.strip(), v.strip()) for v in visible.split(",") if v.strip()]
    out = [u for u in wanted if u not in bad]
    left_out = [u for u in wanted if u in bad]
    if not left_out:
        return None, []
    return ",".join(out), left_out


def held_list(path: Path) -> list[dict]:
    try:
        return read_json(path) if path.exists() else []
    except (OSError, ValueError):
        return []


def read_events(path: Path) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a line still being written
    except FileNotFoundError:
        pass
    return out


# -- devices of ranks -------------------------------------------------------------------------

def step_device(steps: dict[int, dict], step: int) -> str | None:
    """The device a rank ran `step` on, from its step lines."""
    fp = steps.get(step) or {}
    if fp.get("gpu"):
        return f"gpu-{fp['gpu']}"
    if fp.get("cpu") is not None:
        return cpu_device(fp["cpu"], fp.get("host"))
    return None


def repeat_verdict(ledger: Ledger, device: str, incident_id: str, run: str) -> dict | None:
    """The escalation when this failure (incident_id of run) is the Nth on `device` within the window, else None."""
    prior = [e for e in ledger.failures(device) if (e.get("run"), e.get("incident_id")) != (run, incident_id)]
    if len(prior) + 1 < RULES.repeat_limit:
        return None
    runs = sorted({e.get("run") for e in prior if e.get("run")})
    return {"device": device, "failures": [{"incident_id": e.get("incident_id"), "run": e.get("run"),
                                             "step": e.get("step"), "ts": e.get("ts")} for e in prior]
            + [{"incident_id": incident_id, "run": run}],
            "reason": f"{len(prior) + 1} failures on {device} within {RULES.repeat_window_s / 86400:g} days"
                      + (f" (in {len(runs)} run(s))" if runs else "")
                      + ": the device, not chance: hardware"}


def quarantine_prescription(ledger: Ledger, device: str, rank: int) -> dict:
    """Move the rank off the device (on CPU, to the node's cores not quarantined),
    unless the breaker says the node, not the device, is suspect."""
    refused = ledger.breaker(device)
    if refused:
        return {"action": "none", "device": {"id": device, "rank": rank}, "reason": refused,
                "node_unusable": True, "applied": False}
    cpu = parse_cpu_device(device)
    if cpu is None:
        return {"action": "quarantine_device", "device": {"id": device, "rank": rank, "kind": "gpu"},
                "move_to": None, "verified_by": "recurrence", "applied": False}
    core, host = cpu
    off = {c for q in ledger.quarantined() if (x := parse_cpu_device(q)) and x[1] == host for c in (x[0],)}
    healthy = [c for c in node_cpus() if c != core and c not in off]
    return {"action": "quarantine_device",
            "device": {"id": device, "host": host, "rank": rank, "kind": "cpu", "cpus": [core]},
            "move_to": {"cpus": healthy} if healthy else None, "verified_by": "recurrence", "applied": False}


def incident_events(inc: dict, run: str, steps_of) -> list[dict]:
    """The ledger's failure events for a final incident document: the device of
    the rank the verdict pinned it on.  `steps_of(rank)` gives that rank's step lines."""
    rep = inc.get("replay") or {}
    div = rep.get("first_divergence") or {}
    detail = inc.get("detail") or {}
    step = div.get("step", inc.get("detected_step"))
    where: list[tuple] = []
    if (inc.get("escalated") or {}).get("device"):
        where = [(inc["escalated"]["device"], inc["escalated"].get("rank"))]
    elif (inc.get("attribution") or {}).get("cause") == "hardware" and inc.get("prescription"):
        d = inc["prescription"].get("device") or {}
        where = [(cpu_device(c, d.get("host")), d.get("rank")) for c in d.get("cpus") or []]
    elif inc.get("classification") == "transient" and div:
        where = [(div.get("device") or step_device(steps_of(div["rank"]), div["step"]), div["rank"])]
    elif detail.get("found_by") == "audit" and detail.get("device_id"):
        where = [(detail["device_id"], detail.get("rank"))]
    return [{"kind": "failure", "device": device, "rank": rank, "step": step, "run": run,
             "incident_id": inc["incident_id"],
             "detail": {"incident": inc.get("kind"), "classification": inc.get("classification"),
                        "cause": inc.get("transient_cause") or (inc.get("attribution") or {}).get("cause"),
                        "found_by": detail.get("found_by")}}
            for device, rank in where if device]


# -- signals ------------------------------------------------------------------------------------

def edac_counts() -> dict | None:
    """Corrected and uncorrected memory errors the kernel's EDAC drivers counted, if any."""
    root = Path("/sys/devices/system/edac/mc")
    if not root.is_dir():
        return None
    ce = ue = 0
    found = False
    for mc in root.glob("mc*"):
        try:
            ce += int((mc / "ce_count").read_text())
            ue += int((mc / "ue_count").read_text())
            found = True
        except (OSError, ValueError):
            continue
    return {"ce": ce, "ue": ue} if found else None


def nvml_devices() -> list[dict] | None:
    """Each GPU's health counters through NVML (nvidia-ml-py), or None when NVML is absent."""
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:
        return None
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            d = {"index": i, "uuid": _s(pynvml.nvmlDeviceGetUUID(h)), "name": _s(pynvml.nvmlDeviceGetName(h))}
            d.update(_nvml_counters(pynvml, h))
            out.append(d)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass
    return out


class XidListener:
    """XID events as the driver raises them (NVML's event set), each handed to
    `on_event` the moment it comes: a critical XID (module table) is a failure
    of its GPU in the ledger during the run, not at its end.  Counters (ECC,
    remapped rows) are still read at the run's start and end; an XID is an
    event, gone unless someone listens.  Without NVML, or on a board that does
    not deliver XID events, it says so (`state`) and does nothing."""

    WAIT_MS = 500  # how often the thread looks up to see whether it should stop

    def __init__(self, on_event):
        self.on_event = on_event
        self.state = "not started"
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.devices = 0
        self.seen = 0

    def start(self) -> "XidListener":
        try:
            import pynvml
            pynvml.nvmlInit()
        except Exception:
            self.state = "NVML not available"
            return self
        self.nvml = pynvml
        try:
            self.events = pynvml.nvmlEventSetCreate()
            for i in range(pynvml.nvmlDeviceGetCount()):
                try:
                    pynvml.nvmlDeviceRegisterEvents(pynvml.nvmlDeviceGetHandleByIndex(i),
                                                    pynvml.nvmlEventTypeXidCriticalError, self.events)
                    self.devices += 1
                except pynvml.NVMLError:
                    continue  # this board delivers no XID events
        except Exception as e:
            self.state = f"NVML events not available: {e}"
            self._shutdown()
            return self
        if not self.devices:
            self.state = "no GPU delivers XID events"
            self._shutdown()
            return self
        self.state = f"listening on {self.devices} GPU(s)"
        self.thread = threading.Thread(target=self._loop, name="watcher-xid", daemon=True)
        self.thread.start()
        return self

    def _loop(self) -> None:
        pynvml = self.nvml
        while not self.stopped.is_set():
            try:
                data = pynvml.nvmlEventSetWait_v2(self.events, self.WAIT_MS)
            except pynvml.NVMLError_Timeout:
                continue
            except Exception as e:
                self.state = f"stopped listening: {e}"
                return
            try:
                uuid = _s(pynvml.nvmlDeviceGetUUID(data.device))
            except Exception:
                uuid = None
            self.seen += 1
            try:
                self.on_event({"xid": int(data.eventData), "uuid": uuid, "unix": time.time()})
            except Exception:
                pass  # a ledger that cannot be written never stops the listening

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join(self.WAIT_MS / 1000 + 2)
        self._shutdown()

    def _shutdown(self) -> None:
        pynvml = getattr(self, "nvml", None)
        if pynvml is None:
            return
        try:
            if getattr(self, "events", None) is not None:
                pynvml.nvmlEventSetFree(self.events)
            pynvml.nvmlShutdown()
        except Exception:
            pass
        self.nvml = None


def xid_event(run: str, x: dict) -> dict:
    """A ledger event for one XID: a failure of its GPU when critical, a signal otherwise."""
    critical = x["xid"] in CRITICAL_XIDS
    return {"kind": "failure" if critical else "signal", "device": f"gpu-{x['uuid']}", "run": run,
            "detail": {"xid": x["xid"], "bad": [f"XID {x['xid']}"] if critical else [],
                       **({"signal": [f"XID {x['xid']}"]} if critical else {})}}


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _nvml_counters(pynvml, h) -> dict:
    """Every counter one at a time: a board without a feature answers NotSupported for it."""
    def get(fn, *args):
        try:
            return fn(h, *args)
        except Exception:
            return None
    unc, cor = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    vol, agg = pynvml.NVML_VOLATILE_ECC, pynvml.NVML_AGGREGATE_ECC
    rows = get(pynvml.nvmlDeviceGetRemappedRows)  # (correctable, uncorrectable, pending, failure)
    return {
        "ecc_volatile_uncorrected": get(pynvml.nvmlDeviceGetTotalEccErrors, unc, vol),
        "ecc_volatile_corrected": get(pynvml.nvmlDeviceGetTotalEccErrors, cor, vol),
        "ecc_aggregate_uncorrected": get(pynvml.nvmlDeviceGetTotalEccErrors, unc, agg),
        "ecc_aggregate_corrected": get(pynvml.nvmlDeviceGetTotalEccErrors, cor, agg),
        "remapped_rows": list(rows) if rows else None,
        "retired_pages_pending": _bool(get(pynvml.nvmlDeviceGetRetiredPagesPendingStatus)),
        "throttle_reasons": get(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons),
        "pcie_replays": get(pynvml.nvmlDeviceGetPcieReplayCounter),
        "temperature_c": get(pynvml.nvmlDeviceGetTemperature, pynvml.NVML_TEMPERATURE_GPU),
        "nvlink_errors": _nvlink_errors(pynvml, h),
    }


def _bool(v):
    return None if v is None else bool(v)


def _nvlink_errors(pynvml, h) -> int | None:
    total, seen = 0, False
    for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
        for counter in range(4):  # replay, recovery, CRC flit, CRC data
            try:
                total += pynvml.nvmlDeviceGetNvLinkErrorCounter(h, link, counter)
                seen = True
            except Exception:
                break
    return total if seen else None


def bad_signals(now: dict, before: dict | None = None) -> list[str]:
    """What in one GPU's counters is past a threshold (module table)."""
    bad = []
    if (now.get("ecc_volatile_uncorrected") or 0) > ((before or {}).get("ecc_volatile_uncorrected") or 0):
        bad.append(f"volatile uncorrected ECC errors: {now['ecc_volatile_uncorrected']}")
    if now.get("retired_pages_pending"):
        bad.append("page retirement pending (reset the GPU)")
    rows = now.get("remapped_rows")
    if rows and len(rows) == 4 and rows[3]:
        bad.append("row remapping failed")
    for x in now.get("xids") or []:
        if x in CRITICAL_XIDS:
            bad.append(f"XID {x}")
    return bad


def nvml_line() -> str:
    """One line on what NVML says: absent is a fact, not an error."""
    devs = nvml_devices()
    if devs is None:
        return "NVML: not available (no NVIDIA driver or nvidia-ml-py): device health from CPU cores and EDAC only"
    if not devs:
        return "NVML: driver loaded, 0 GPUs"
    parts = []
    for d in devs:
        b = bad_signals(d)
        parts.append(f"GPU {d['index']} {d['name']} {d['uuid']}: " + ("; ".join(b) if b else "healthy")
                     + (f", {d['temperature_c']} C" if d.get("temperature_c") is not None else ""))
    return "NVML: " + " | ".join(parts)


def signal_events(run: str, before: dict | None = None) -> tuple[list[dict], dict]:
    """Signal events for the node's devices now, judged against `before` (the run's start)."""
    events, state = [], {"edac": edac_counts(), "gpus": {}}
    host = os.uname().nodename
    devs = nvml_devices() or []
    for d in devs:
        prev = ((before or {}).get("gpus") or {}).get(d["uuid"])
        bad = bad_signals(d, prev)
        state["gpus"][d["uuid"]] = d
        events.append({"kind": "signal", "device": f"gpu-{d['uuid']}", "run": run, "detail": dict(d, bad=bad)})
        if bad:
            events.append({"kind": "failure", "device": f"gpu-{d['uuid']}", "run": run,
                           "detail": {"signal": bad}})
    edac = state["edac"]
    if edac is not None:
        grew = before and before.get("edac") and edac["ue"] > before["edac"]["ue"]
        events.append({"kind": "signal", "device": f"memory@{host}", "run": run,
                       "detail": dict(edac, bad=["uncorrected memory errors rose"] if grew else [])})
        if grew:
            events += [{"kind": "failure", "device": cpu_device(c, host), "run": run,
                        "detail": {"signal": ["uncorrected memory errors rose"]}} for c in node_cpus()]
    return events, state


# -- reading a ledger (`watcher health`) --------------------------------------------------------

def summary(ledger: Ledger) -> dict:
    """Per device: failures (all, and within the repeat window), signals past a threshold, quarantine."""
    now = time.time()
    devices: dict[str, dict] = {}
    for e in ledger.events():
        if e.get("kind") == "cleared":
            continue
        d = devices.setdefault(e.get("device") or "?", {"failures": 0, "recent_failures": 0, "bad_signals": [],
                                                        "incidents": [], "quarantined": False, "last_ts": None})
        d["last_ts"] = max(d["last_ts"] or 0, e.get("ts") or 0)
        if e.get("kind") == "failure":
            d["failures"] += 1
            d["recent_failures"] += now - (e.get("ts") or 0) <= RULES.repeat_window_s
            if e.get("incident_id"):
                d["incidents"].append(f"{e.get('run') or ''}:{e['incident_id']}")
        elif e.get("kind") == "signal":
            d["bad_signals"] += (e.get("detail") or {}).get("bad") or []
    for q in ledger.quarantined():
        devices.setdefault(q, {"failures": 0, "recent_failures": 0, "bad_signals": [], "incidents": [],
                               "last_ts": None})["quarantined"] = True
    unusable = None
    if ledger.unusable_file is not None and ledger.unusable_file.exists():
        unusable = read_json(ledger.unusable_file)
    return {"devices": devices, "quarantine": held_list(ledger.quarantine_file) if ledger.quarantine_file
            else [{"device": q} for q in ledger.quarantined()], "unusable": unusable,
            "rules": {"repeat_limit": RULES.repeat_limit, "repeat_window_s": RULES.repeat_window_s,
                      "max_quarantine_share": RULES.max_quarantine_share}}


def describe(s: dict, where: str) -> str:
    lines = [f"device health of {where}: {len(s['devices'])} device(s) in the ledger; rule: "
             f"{s['rules']['repeat_limit']} failures within {s['rules']['repeat_window_s'] / 86400:g} days "
             f"quarantine a device, at most {100 * s['rules']['max_quarantine_share']:g}% of a node's"]
    for name, d in sorted(s["devices"].items()):
        state = "QUARANTINED" if d.get("quarantined") else "suspect" if d["recent_failures"] else "healthy"
        lines.append(f"  {name:<28} {state:<11} failures {d['failures']} ({d['recent_failures']} recent)"
                     + (f"; signals: {', '.join(sorted(set(d['bad_signals'])))}" if d["bad_signals"] else "")
                     + (f"; incidents {', '.join(d['incidents'][-4:])}" if d["incidents"] else ""))
    for q in s["quarantine"]:
        lines.append(f"  quarantined: {q['device']}" + (f" since incident {q['incident_id']}" if q.get("incident_id")
                                                       else "") + (f": {q['reason']}" if q.get("reason") else ""))
    if s["unusable"]:
        lines.append(f"  NODE UNUSABLE: {s['unusable'].get('reason')}")
    return "\n".join(lines)


def clear(ledger: Ledger, device: str) -> list[str]:
    """Take `device` (or every device, "all") off the node's quarantine, and the node's unusable mark with it."""
    held = held_list(ledger.quarantine_file)
    keep = [] if device == "all" else [q for q in held if q["device"] != device]
    gone = [q["device"] for q in held if q not in keep]
    write_json(ledger.quarantine_file, keep)
    for g in gone:
        ledger.add({"kind": "cleared", "device": g})
    if ledger.unusable_file.exists() and (device == "all" or not keep):
        ledger.unusable_file.unlink()
        ledger.add({"kind": "cleared", "device": "node"})
        gone.append("the node's unusable mark")
    return gone
