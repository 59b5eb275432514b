-- Named views over a recording: the common questions, answered once.
-- Each view starts with "-- view: NAME -- doc" and documents its columns with
-- "-- column: NAME -- doc" lines; watcher/schema.py parses this file.

-- view: blocked_thread -- Threads inside a system call at the last flush, longest blocked first: what each thread is blocked on.
-- column: utid -- Thread.
-- column: tid -- Kernel thread id.
-- column: thread_name -- Thread name.
-- column: upid -- Process.
-- column: pid -- Kernel process id.
-- column: rank -- torch.distributed rank of the process, if any.
-- column: syscall -- Name of the call in progress (futex, epoll_wait, read, ...).
-- column: since_ts -- When the call was entered.
-- column: blocked_ns -- How long it had been in the call at the snapshot.
-- column: arg0 -- First argument: the futex address, fd, ...
SELECT i.utid, t.tid, t.name AS thread_name, i.upid, p.pid, p.rank,
       i.name AS syscall, i.ts AS since_ts, i.snapshot_ts - i.ts AS blocked_ns, i.arg0
FROM inflight_syscall i
LEFT JOIN thread t USING (utid)
LEFT JOIN process p ON p.upid = i.upid
ORDER BY blocked_ns DESC;

-- view: top_syscall -- System calls ranked by total time, from the exact per-thread counters.
-- column: name -- Syscall name.
-- column: calls -- Number of calls, logged or not.
-- column: total_ns -- Total time in the call.
-- column: avg_ns -- Mean time per call.
-- column: threads -- Threads that made the call.
-- column: idle_skipped -- Calls counted but not logged (idle polls, socket transfers that did not block).
SELECT name, sum(count)::BIGINT AS calls, sum(dur_total)::BIGINT AS total_ns,
       (sum(dur_total) / nullif(sum(count), 0))::BIGINT AS avg_ns,
       count(DISTINCT utid) AS threads, sum(idle_skipped)::BIGINT AS idle_skipped
FROM syscall_stat
GROUP BY name
ORDER BY total_ns DESC;

-- view: thread_timeline -- Every recorded event of every thread in time order: syscalls, futex calls and signals.
-- column: utid -- Thread.
-- column: ts -- Event start.
-- column: dur -- Event duration (0 for signals).
-- column: source -- Table the event came from: syscall, futex or signal.
-- column: name -- Syscall name, futex op name, or signal name.
-- column: ret -- Return value (NULL for signals).
-- column: detail -- Short description of the arguments.
SELECT utid, ts, dur, 'syscall' AS source, name, ret,
       printf('arg0=%d arg1=%d arg2=%d', arg0, arg1, arg2) AS detail
FROM syscall
UNION ALL
SELECT utid, ts, dur, 'futex', op_name, ret,
       printf('%s uaddr=0x%x val=%d', kind, uaddr, val)
FROM futex
UNION ALL
SELECT utid, ts, 0, 'signal', name, NULL,
       printf('%s target_tid=%d code=%d', kind, target_tid, code)
FROM signal
ORDER BY utid, ts;

-- view: process_tree -- Processes with their depth and ancestry path from the recording's root processes.
-- column: upid -- Process.
-- column: pid -- Kernel process id.
-- column: parent_upid -- Parent process.
-- column: depth -- 0 for a root.
-- column: path -- Ancestor pids from the root down, e.g. 100/101/105.
-- column: name -- Command name.
-- column: cmdline -- Command line.
-- column: rank -- torch.distributed rank, if any.
-- column: exit_code -- Exit code, if it exited normally.
-- column: exit_signal -- Killing signal, if any.
WITH RECURSIVE tree(upid, pid, parent_upid, depth, path) AS (
    SELECT upid, pid, parent_upid, 0, CAST(pid AS VARCHAR)
    FROM process
    WHERE parent_upid IS NULL OR parent_upid NOT IN (SELECT upid FROM process)
    UNION ALL
    SELECT c.upid, c.pid, c.parent_upid, t.depth + 1, t.path || '/' || CAST(c.pid AS VARCHAR)
    FROM process c JOIN tree t ON c.parent_upid = t.upid
)
SELECT t.upid, t.pid, t.parent_upid, t.depth, t.path, p.name, p.cmdline, p.rank,
       p.exit_code, p.exit_signal
FROM tree t JOIN process p USING (upid)
ORDER BY t.path;

-- view: futex_handoff -- Each futex wait joined to the wake that ended it: who woke whom, and how long the wakee waited.
-- column: waiter_utid -- Thread that waited.
-- column: waker_utid -- Thread whose wake ended the wait.
-- column: uaddr -- Futex address of the wait.
-- column: wait_ts -- Wait entry time.
-- column: wait_dur -- Time blocked.
-- column: wake_ts -- Entry time of the wake call.
-- column: wake_to_return_ns -- From the wake call to the waiter's return: wake-up latency.
-- column: wake_futex_id -- futex_id of the wake row, NULL if that row was not logged.
SELECT w.utid AS waiter_utid, w.waker_utid, w.uaddr, w.ts AS wait_ts, w.dur AS wait_dur,
       w.wake_ts, (w.ts + w.dur) - w.wake_ts AS wake_to_return_ns, k.futex_id AS wake_futex_id
FROM futex w
LEFT JOIN futex k ON k.kind = 'wake' AND k.utid = w.waker_utid AND k.ts = w.wake_ts
WHERE w.kind = 'wait' AND w.waker_utid IS NOT NULL;

-- view: cuda_call -- CUDA runtime calls (libcudart), with decoded errors: what each rank asked of the GPU.
-- column: ts -- Entry time.
-- column: dur -- Time in the call (NULL if it never returned).
-- column: utid -- Calling thread.
-- column: upid -- Calling process.
-- column: rank -- torch.distributed rank of the process, if any.
-- column: call -- CUDA function, e.g. cudaLaunchKernel, cudaMemcpyAsync.
-- column: error -- cudaError_t name of the return value.
-- column: failed -- True when the call did not return cudaSuccess.
-- column: detail -- Decoded arguments.
-- column: py_site -- The line of the user's Python code that made the call (api_call.py_site).
SELECT a.ts, a.dur, a.utid, a.upid, p.rank, a.symbol AS call, a.ret_name AS error,
       a.ret IS NOT NULL AND a.ret <> 0 AS failed, a.detail, a.py_site
FROM api_call a LEFT JOIN process p ON p.upid = a.upid
WHERE a.library = 'libcudart'
ORDER BY a.ts;

-- view: nccl_call -- NCCL calls (libnccl) with decoded results: communicator set-up, collectives, groups, aborts.
-- column: ts -- Entry time.
-- column: dur -- Time in the call (NULL if it never returned).
-- column: utid -- Calling thread.
-- column: upid -- Calling process.
-- column: rank -- torch.distributed rank of the process, if any.
-- column: call -- NCCL function, e.g. ncclAllReduce, ncclCommInitRank.
-- column: result -- ncclResult_t name of the return value.
-- column: failed -- True when the call did not return ncclSuccess.
-- column: detail -- Decoded arguments (count, datatype, op, comm, stream).
-- column: py_site -- The line of the user's Python code that made the call (api_call.py_site).
SELECT a.ts, a.dur, a.utid, a.upid, p.rank, a.symbol AS call, a.ret_name AS result,
       a.ret IS NOT NULL AND a.ret <> 0 AS failed, a.detail, a.py_site
FROM api_call a LEFT JOIN process p ON p.upid = a.upid
WHERE a.library = 'libnccl'
ORDER BY a.ts;
