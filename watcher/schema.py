"""The recording schema, declared once.

Every table and column is declared here with its doc string.  The DuckDB DDL,
docs/schema.md and the checks in tests/test_schema.py are all generated from
these declarations, so a column cannot exist undocumented.

Conventions (after Perfetto's trace processor): singular snake_case table
names; `ts` and `dur` are integer nanoseconds on CLOCK_MONOTONIC; processes and
threads are referred to by surrogate ids `upid` and `utid`, because raw pids
and tids are recycled; foreign keys are named after the table they point to.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    doc: str
    # A surrogate id (or reference to one); shifted apart when several
    # recordings are queried as one database.
    surrogate: bool = False


@dataclass(frozen=True)
class Table:
    name: str
    doc: str
    columns: tuple[Column, ...]

    def ddl(self) -> str:
        cols = ",\n  ".join(f"{c.name} {c.type}" for c in self.columns)
        return f"CREATE TABLE IF NOT EXISTS {self.name} (\n  {cols}\n);"

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]


@dataclass(frozen=True)
class View:
    name: str
    doc: str
    sql: str
    columns: dict[str, str] = field(default_factory=dict)


def C(name: str, type: str, doc: str, surrogate: bool = False) -> Column:
    return Column(name, type, doc, surrogate)


TS = "BIGINT"

TABLES: tuple[Table, ...] = (
    Table("meta", "Key/value facts about the recording: versions, host, target, probes, totals.", (
        C("key", "VARCHAR", "Name of the fact, e.g. schema_version, target_pid, start_ts."),
        C("value", "VARCHAR", "Its value, as text."),
    )),
    Table("process", "One row per process seen in the traced tree (a recycled pid gets a new row).", (
        C("upid", "INTEGER", "Surrogate process id, unique within the recording.", True),
        C("pid", "INTEGER", "Kernel process id (tgid)."),
        C("parent_upid", "INTEGER", "upid of the parent process, NULL for the root of the recording.", True),
        C("ppid", "INTEGER", "Kernel pid of the parent at fork (or at attach)."),
        C("name", "VARCHAR", "Command name (comm) after the last exec."),
        C("cmdline", "VARCHAR", "Arguments of the last exec, space separated (first 12, each cut at 63 bytes)."),
        C("exe", "VARCHAR", "Filename passed to the last exec."),
        C("start_ts", TS, "Fork time, or when recording started for processes that already existed."),
        C("end_ts", TS, "Time the whole process exited, NULL while alive."),
        C("exit_code", "INTEGER", "Exit code when it exited normally, else NULL."),
        C("exit_signal", "INTEGER", "Signal number that killed it, else NULL."),
        C("rank", "INTEGER", "torch.distributed RANK from the process environment, NULL when not a rank (nor is a "
                             "rank's supervisor under `watcher run`: its child is, and so is a snapshot that took "
                             "the rank over after a rescue)."),
        C("local_rank", "INTEGER", "LOCAL_RANK from the process environment."),
        C("world_size", "INTEGER", "WORLD_SIZE from the process environment."),
    )),
    Table("thread", "One row per thread seen in the traced tree.", (
        C("utid", "INTEGER", "Surrogate thread id, unique within the recording.", True),
        C("tid", "INTEGER", "Kernel thread id."),
        C("upid", "INTEGER", "Process the thread belongs to.", True),
        C("name", "VARCHAR", "Thread name (comm), as last read."),
        C("start_ts", TS, "Clone time, or when recording started for threads that already existed."),
        C("end_ts", TS, "Exit time, NULL while alive."),
        C("is_main_thread", "BOOLEAN", "True for the thread whose tid equals its process's pid."),
    )),
    Table("syscall", "One completed system call (futex calls are in `futex`; idle polls are only counted, in `syscall_stat`).", (
        C("ts", TS, "Entry time."),
        C("dur", TS, "Time from entry to return."),
        C("utid", "INTEGER", "Calling thread.", True),
        C("upid", "INTEGER", "Calling process.", True),
        C("nr", "INTEGER", "x86_64 syscall number."),
        C("name", "VARCHAR", "Syscall name."),
        C("ret", "BIGINT", "Return value; negative values are -errno."),
        C("arg0", "UBIGINT", "First raw argument."),
        C("arg1", "UBIGINT", "Second raw argument."),
        C("arg2", "UBIGINT", "Third raw argument."),
        C("arg3", "UBIGINT", "Fourth raw argument."),
        C("arg4", "UBIGINT", "Fifth raw argument."),
        C("arg5", "UBIGINT", "Sixth raw argument."),
        C("cpu", "INTEGER", "CPU the call returned on."),
    )),
    Table("futex", "Futex waits, and futex wakes that woke at least one waiter.", (
        C("futex_id", "BIGINT", "Row id, unique within the recording."),
        C("ts", TS, "Entry time of the futex call."),
        C("dur", TS, "Time in the call; for a wait, the time blocked."),
        C("utid", "INTEGER", "Calling thread.", True),
        C("upid", "INTEGER", "Calling process.", True),
        C("kind", "VARCHAR", "'wait' or 'wake'."),
        C("op", "INTEGER", "Raw futex op, flags included."),
        C("op_name", "VARCHAR", "Futex command name, e.g. FUTEX_WAIT_BITSET."),
        C("uaddr", "UBIGINT", "Futex word address in the caller's address space."),
        C("val", "BIGINT", "The val argument (expected value for waits, count for wakes)."),
        C("timeout_ns", TS, "Wait timeout in ns as passed (relative or absolute per op), NULL if none."),
        C("ret", "BIGINT", "Return value: waits 0 or -errno (-110 ETIMEDOUT, -11 EAGAIN); wakes the number woken."),
        C("waker_utid", "INTEGER", "Waits: the thread whose wake ended this wait, NULL if none (timeout, signal).", True),
        C("wake_ts", TS, "Waits: entry ts of that wake call; joins to futex.ts of the wake row."),
    )),
    Table("signal", "Signals generated by or sent to traced processes, and their deliveries.", (
        C("ts", TS, "Time of the event."),
        C("kind", "VARCHAR", "'generate' (sent) or 'deliver' (taken by the target thread)."),
        C("signo", "INTEGER", "Signal number."),
        C("name", "VARCHAR", "Signal name, e.g. SIGTERM."),
        C("utid", "INTEGER", "Thread the event ran on: the sender for generate, the receiver for deliver.", True),
        C("upid", "INTEGER", "Process of that thread, NULL if it is not traced.", True),
        C("sender_pid", "INTEGER", "Kernel pid of the sending process (generate) or receiving process (deliver)."),
        C("target_tid", "INTEGER", "Kernel id of the target task (a pid for kill(2), a tid for tgkill(2))."),
        C("target_utid", "INTEGER", "The target as a traced thread, when known.", True),
        C("code", "INTEGER", "si_code (0 SI_USER from kill, -6 SI_TKILL, positive from the kernel)."),
        C("result", "INTEGER", "Generate: 0 delivered, 1 ignored, 2 already pending, 3 overflow, 4 lose info."),
    )),
    Table("file_open", "Every open(2)-family call (open, openat, openat2, creat) with its path: which files the job read and wrote.", (
        C("ts", TS, "Time the call entered."),
        C("dur", "BIGINT", "Time in the call, ns."),
        C("utid", "INTEGER", "Calling thread.", True),
        C("upid", "INTEGER", "Its process.", True),
        C("path", "VARCHAR", "The path as passed (a relative path stays relative), at most 111 bytes."),
        C("flags", "INTEGER", "O_* flags (octal 1 O_WRONLY, 2 O_RDWR, 100 O_CREAT, 1000 O_TRUNC, 2000000 O_CLOEXEC)."),
        C("writes", "BOOLEAN", "Opened for writing (O_WRONLY or O_RDWR) or to create."),
        C("ret", "BIGINT", "The new descriptor, or -errno."),
        C("syscall", "VARCHAR", "open, openat, openat2 or creat."),
    )),
    Table("api_call", "One library call caught by a uprobe (libtorch, libcudart, libnccl), entry to return.", (
        C("api_call_id", "BIGINT", "Row id, unique within the recording."),
        C("ts", TS, "Entry time."),
        C("dur", TS, "Entry to return (0 for entry-only probes)."),
        C("utid", "INTEGER", "Calling thread.", True),
        C("upid", "INTEGER", "Calling process.", True),
        C("library", "VARCHAR", "Spec library: libtorch, libcudart or libnccl."),
        C("probe", "VARCHAR", "Spec probe name, e.g. cudaMalloc, gloo.allreduce, op."),
        C("symbol", "VARCHAR", "Function, demangled (operator probes: the op name, e.g. mm)."),
        C("ret", "BIGINT", "Integer return value (rax)."),
        C("ret_name", "VARCHAR", "Decoded return code (cudaError_t / ncclResult_t), NULL if not an error enum."),
        C("arg0", "UBIGINT", "First integer argument register."),
        C("arg1", "UBIGINT", "Second integer argument register."),
        C("arg2", "UBIGINT", "Third integer argument register."),
        C("arg3", "UBIGINT", "Fourth integer argument register."),
        C("arg4", "UBIGINT", "Fifth integer argument register."),
        C("arg5", "UBIGINT", "Sixth integer argument register."),
        C("deref", "BIGINT", "Value read through the pointer argument the spec names (e.g. *count), NULL if none."),
        C("detail", "VARCHAR", "Arguments decoded per the spec, as name=value pairs."),
        C("file", "VARCHAR", "Library file the probe was attached to (from /proc/PID/maps)."),
        C("py_stack", "VARCHAR", "Python stack of the calling thread at entry, innermost frame first, one "
          "'file:line function' per line (CPython 3.11; NULL for other interpreters and operator probes)."),
        C("py_site", "VARCHAR", "The innermost py_stack frame in the user's code (not the standard library, an "
          "installed package or Watcher): the line that made the call."),
    )),
    Table("collective", "c10d collectives issued by each rank, numbered per process group.", (
        C("api_call_id", "BIGINT", "The api_call row of the call."),
        C("ts", TS, "Entry time of the call."),
        C("dur", TS, "Time in the call (gloo enqueues work and returns; completion is asynchronous)."),
        C("utid", "INTEGER", "Calling thread.", True),
        C("upid", "INTEGER", "Calling process.", True),
        C("rank", "INTEGER", "RANK of the calling process, NULL if unknown."),
        C("backend", "VARCHAR", "Process group backend, e.g. gloo."),
        C("pg", "UBIGINT", "Process group object address in the calling process."),
        C("group_index", "INTEGER", "Order in which this process first used the group (0, 1, ...): equal across ranks for the same group."),
        C("seq", "INTEGER", "Per (process, group) sequence number of the collective, from 0."),
        C("op", "VARCHAR", "allreduce, broadcast, allgather, reduce_scatter, alltoall, barrier, send, recv."),
        C("tensor_count", "INTEGER", "Tensors in the call's tensor list, NULL where not decoded."),
        C("numel", "BIGINT", "Elements of the first tensor, NULL where not decoded."),
        C("dtype", "VARCHAR", "dtype of the first tensor (float32, bfloat16, ...), NULL where not decoded."),
        C("bytes", "BIGINT", "numel times the element size of the first tensor."),
        C("state", "VARCHAR", "'returned' once the call returned, 'entered' if it never did."),
    )),
    Table("syscall_stat", "Exact per-thread per-syscall totals, including calls that were counted but not logged.", (
        C("utid", "INTEGER", "Thread.", True),
        C("upid", "INTEGER", "Process.", True),
        C("nr", "INTEGER", "Syscall number."),
        C("name", "VARCHAR", "Syscall name."),
        C("count", "BIGINT", "Every completed call."),
        C("dur_total", TS, "Sum of the durations of every call."),
        C("logged", "BIGINT", "Calls written as rows (to `syscall` or `futex`), before any drop."),
        C("idle_skipped", "BIGINT", "Calls counted but not logged: idle poll/epoll/select calls (timed "
          "out with nothing, ret 0, or returned ready without blocking 1 ms); socket transfers "
          "(recvfrom, sendto, recvmsg, sendmsg, recvmmsg, sendmmsg) that returned within 1 ms having "
          "moved data, or with EAGAIN; and uretprobe(2), the trampoline of Watcher's own return probes."),
    )),
    Table("inflight_syscall", "Threads inside a system call when the recording was last flushed: where each thread is blocked.", (
        C("snapshot_ts", TS, "When the kernel's in-flight table was read."),
        C("utid", "INTEGER", "Thread.", True),
        C("upid", "INTEGER", "Process.", True),
        C("nr", "INTEGER", "Syscall number."),
        C("name", "VARCHAR", "Syscall name."),
        C("ts", TS, "Entry time of the call still in progress."),
        C("arg0", "UBIGINT", "First raw argument (fd, futex address, ...)."),
        C("arg1", "UBIGINT", "Second raw argument (futex op, buffer, ...)."),
    )),
    Table("ring_drop", "Per-ring, per-CPU counts of records the kernel could not queue (ring full).", (
        C("ring", "VARCHAR", "Ring name: syscall, futex, proc or signal."),
        C("cpu", "INTEGER", "CPU."),
        C("drops", "BIGINT", "Records dropped on that CPU."),
    )),
    Table("step", "One optimizer step of one rank, as seen by the runtime `watcher run` injects.", (
        C("rank", "INTEGER", "RANK of the process."),
        C("step", "INTEGER", "Optimizer step index, from 0; the state 'at step k' is after step k's update."),
        C("ts", TS, "When the step ended (its optimizer step returned)."),
        C("dur", TS, "Time since the previous step ended, NULL for the first."),
        C("loss", "DOUBLE", "Loss of the step: the root of its last scalar backward()."),
        C("grad_norm", "DOUBLE", "L2 norm of the main optimizer's gradients: as reduced across ranks (before any "
                                  "clipping) where the step's float32 allreduces carry exactly the gradients, as DDP's do; "
                                  "otherwise as the optimizer finds them."),
        C("param_sum", "BIGINT", "Checksum of part step % 4 of the parameters after the update (their 32-bit words in optimizer order, cut into 4 equal ranges: each word is covered every 4 steps); equal across DDP replicas."),
        C("batch_sum", "BIGINT", "Checksum of the batches fetched during the step, NULL if none was seen."),
        C("rng", "BIGINT", "Digest of the CPU generator state (its 32-bit word sum; CRC32 where wordsum.c is not built)."),
        C("n_coll", "INTEGER", "Collectives that completed during the step."),
        C("snapshot", "BOOLEAN", "A fork snapshot was taken at the end of this step."),
        C("watcher_us", "BIGINT", "Time the rank spent in Watcher's own code during the step (hooks, checksums, "
          "collective capture, a snapshot's fork), microseconds: what Watcher cost this step."),
    )),
    Table("collective_io", "Every collective through Watcher's process-group wrapper: input and output checksums.", (
        C("rank", "INTEGER", "RANK of the process."),
        C("group_name", "VARCHAR", "c10d group name ('0' is the default group); equal across member ranks."),
        C("seq", "INTEGER", "Sequence number within the group, from 1; matches across ranks."),
        C("op", "VARCHAR", "allreduce, broadcast, allgather, _allgather_base, reduce_scatter, barrier, send, recv, ..."),
        C("step", "INTEGER", "The step the collective belongs to (the step in progress when it was issued)."),
        C("numel", "BIGINT", "Elements over all input tensors (outputs when there are no inputs)."),
        C("dtype", "VARCHAR", "dtype of the first tensor."),
        C("reduce_op", "VARCHAR", "SUM, AVG, MAX, ... for reductions."),
        C("in_sum", "BIGINT", "Checksum of the inputs when the call was issued."),
        C("out_sum", "BIGINT", "Checksum of the outputs when the work completed."),
        C("site", "VARCHAR", "file:line of the Python code that issued it (for DDP's allreduces, the backward() call)."),
        C("ts", TS, "When the call was issued."),
        C("dur", TS, "Issue to completion."),
    )),
    Table("incident", "Failures detected by `watcher run`, with the replay verdict; the full JSON is in DIR/incidents/.", (
        C("incident_id", "VARCHAR", "inc-0001, ..."),
        C("kind", "VARCHAR", "crash, hang, sdc (replicas disagree, or the background audit's re-execution departed "
                             "from the record: detail.found_by = 'audit'), loss_spike, non_finite, collective_error "
                             "(a collective's transport failed), stall or straggler (reports: nothing halted)."),
        C("detected_step", "INTEGER", "The failing step."),
        C("detected_rank", "INTEGER", "The rank whose detector fired (or that crashed)."),
        C("detected_ts", TS, "When it was detected."),
        C("from_step", "INTEGER", "Replay window: the verified snapshot's step."),
        C("to_step", "INTEGER", "Replay window: the last replayed step."),
        C("reproduced", "BOOLEAN", "Did the replay reproduce the failure? NULL if no replay was possible."),
        C("divergence_rank", "INTEGER", "First divergence: rank."),
        C("divergence_step", "INTEGER", "First divergence: step."),
        C("divergence_collective", "VARCHAR", "First divergence: group/seq op of the collective."),
        C("divergence_where", "VARCHAR", "compute (the rank computed different inputs) or communication (an output is not the reduction of the inputs)."),
        C("classification", "VARCHAR", "transient or persistent, NULL if undecided."),
        C("track", "VARCHAR", "A (recover) or B (diagnose)."),
        C("transient_cause", "VARCHAR", "bit_flip, communication, timeout or unknown."),
        C("recovered", "BOOLEAN", "Was the verified state merged back into the live run?"),
        C("resumed_at_step", "INTEGER", "After a recovery: the first step the live run trained on the recovered state."),
        C("steps_lost", "INTEGER", "After a recovery: steps that had to be trained again (0: the replay recomputed them)."),
        C("detect_to_resume_s", "DOUBLE", "After a recovery: seconds from detection to the live ranks running again."),
        C("attribution", "VARCHAR", "Persistent failures, from counterfactual replay: data, hardware, params, software or unknown."),
        C("attribution_confidence", "DOUBLE", "0..1: how decisive the counterfactual replays were."),
        C("prescription", "VARCHAR", "skip_batch, adjust_params, quarantine_device, fix_kernel or none; details in the JSON."),
        C("prescription_applied", "BOOLEAN", "Under --policy apply: was it applied and training continued from the failing step?"),
        C("json", "VARCHAR", "The whole incident document."),
    )),
    Table("causal_link", "An incident's causal chain, one row per link, root cause first (diagnosis of persistent failures).", (
        C("incident_id", "VARCHAR", "The incident."),
        C("position", "INTEGER", "0 is the root cause; the last link is the detection."),
        C("kind", "VARCHAR", "batch, device, hyperparameter, op, loss, collective, native (a crash's faulting "
                             "native frame), code (a Python frame of a crash) or detector."),
        C("step", "INTEGER", "Training step of the link."),
        C("rank", "INTEGER", "Rank of the link, where it has one."),
        C("module", "VARCHAR", "Module path (e.g. blocks.0.mlp.1), for an op; file:line for code; the "
                               "nearest named native frame for native."),
        C("op", "VARCHAR", "Operator (e.g. aten::div.Tensor), for an op; the function for code; object+offset "
                           "for native."),
        C("collective", "VARCHAR", "group/seq op, for a collective."),
        C("evidence", "VARCHAR", "What the replays showed, in words."),
    )),
    Table("sandbox_event", "Calls a replay made on the live job's descriptors or the network, and what the sandbox did.", (
        C("incident_id", "VARCHAR", "The incident whose replay made the call."),
        C("rank", "INTEGER", "Rank being replayed."),
        C("ts", TS, "When the call was trapped."),
        C("pid", "INTEGER", "Replay process."),
        C("syscall", "VARCHAR", "System call name."),
        C("fd", "INTEGER", "Inherited descriptor, where the call takes one."),
        C("action", "VARCHAR", "denied (EPERM), swallowed (reported done, nothing happened), redirected to /dev/null, or not allowed (ENOSYS: a call not on the replay's allowlist)."),
    )),
    Table("protection", "Ranks of a `watcher run` job on which snapshots and replay were off, or a part of "
          "protection was, and why (functional collectives, "
          "an unreachable store, ...): said at once on the job's stderr, never silent.", (
        C("rank", "INTEGER", "Global rank."),
        C("reason", "VARCHAR", "Why, in words, and what still runs."),
        C("unix_time", "DOUBLE", "When the rank found out (Unix time, s)."),
    )),
    Table("audit", "The background SDC audit of a `watcher run` job (watcher/runtime/audit.py): one row per rank "
          "per window re-executed off the training path and compared with the record.", (
        C("rank", "INTEGER", "Global rank."),
        C("audit", "INTEGER", "The audit's number (rank 0 orders them); every rank replays the same window."),
        C("from_step", "INTEGER", "The window replayed is from_step+1..to_step (NULL when skipped before it began)."),
        C("to_step", "INTEGER", "Last step of the window."),
        C("status", "VARCHAR", "clean (matched the record), mismatch (departed: an sdc incident), failed, "
                               "skipped (an incident, the job's end)."),
        C("steps", "INTEGER", "Steps the replay re-executed."),
        C("mismatched_steps", "VARCHAR", "JSON list of the steps whose fingerprint departed from the record."),
        C("cpu_s", "DOUBLE", "CPU the replay used (s)."),
        C("wall_s", "DOUBLE", "Wall time of the replay (s), at the lowest CPU priority."),
        C("error", "VARCHAR", "Why it failed or was skipped."),
        C("unix_time", "DOUBLE", "When it ended (Unix time, s)."),
    )),
    Table("health_event", "The device health ledger of a `watcher run` job (watcher/health.py; DIR/health.jsonl): "
          "health signals read from each device and every failure pinned on one.", (
        C("unix_time", "DOUBLE", "When (Unix time, s)."),
        C("kind", "VARCHAR", "failure (an incident pinned on the device), quarantine (taken out of use, or refused "
                             "by the breaker: detail.refused), signal (NVML or EDAC counters; detail.bad lists what "
                             "is past a threshold)."),
        C("device", "VARCHAR", "cpu<N>@<host> (a core), gpu-<uuid>, or memory@<host> (EDAC)."),
        C("rank", "INTEGER", "Global rank that ran on the device, for a failure."),
        C("step", "INTEGER", "The step that failed there."),
        C("incident_id", "VARCHAR", "The incident, for a failure or a quarantine."),
        C("detail", "VARCHAR", "JSON: the incident's kind, classification and cause; the counters of a signal."),
    )),
    Table("prune", "Data removed to respect --max-size or --ring-minutes; what is missing, never silently.", (
        C("ts", TS, "When the prune happened."),
        C("table_name", "VARCHAR", "Table rows were removed from."),
        C("before_ts", TS, "Every row with ts earlier than this was removed."),
        C("rows", "BIGINT", "Rows removed."),
    )),
)

TABLE_BY_NAME = {t.name: t for t in TABLES}


def _views() -> tuple[View, ...]:
    from importlib.resources import files

    text = files("watcher.analysis").joinpath("views.sql").read_text()
    views = []
    for block in text.split("\n-- view: ")[1:]:
        header, _, body = block.partition("\n")
        name, _, doc = header.partition(" -- ")
        cols = {}
        sql_lines = []
        for line in body.splitlines():
            if line.startswith("-- column: "):
                cname, _, cdoc = line[len("-- column: "):].partition(" -- ")
                cols[cname.strip()] = cdoc.strip()
            else:
                sql_lines.append(line)
        views.append(View(name.strip(), doc.strip(), "\n".join(sql_lines).strip().rstrip(";"), cols))
    return tuple(views)


VIEWS: tuple[View, ...] = _views()


def create_statements() -> list[str]:
    return [t.ddl() for t in TABLES]


def view_statements() -> list[str]:
    return [f"CREATE OR REPLACE VIEW {v.name} AS\n{v.sql}" for v in VIEWS]


def markdown() -> str:
    """docs/schema.md, generated."""
    out = [
        "# Recording schema",
        "",
        f"Schema version {SCHEMA_VERSION}. Generated from `watcher/schema.py` by "
        "`watcher schema --markdown`; do not edit by hand.",
        "",
        "`ts` and `dur` are nanoseconds on CLOCK_MONOTONIC. `upid`/`utid` are surrogate ids "
        "(pids and tids are recycled).",
        "",
        "## Tables",
        "",
    ]
    for t in TABLES:
        out += [f"### `{t.name}`", "", t.doc, "", "| column | type | meaning |", "|---|---|---|"]
        out += [f"| `{c.name}` | {c.type} | {c.doc} |" for c in t.columns]
        out.append("")
    out += ["## Views", ""]
    for v in VIEWS:
        out += [f"### `{v.name}`", "", v.doc, "", "| column | meaning |", "|---|---|"]
        out += [f"| `{k}` | {d} |" for k, d in v.columns.items()]
        out.append("")
    return "\n".join(out)
