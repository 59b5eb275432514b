"""Fault injection for drills.  Nothing else in Watcher reads this module.

`watcher drill` sets WATCHER_INJECT to a JSON fault; this module turns it into
hooks on the runtime's fault points.  Transient faults fire once, in the live
rank only, as a real cosmic-ray bit flip or network glitch would: they check
`rt.mode == "live"` themselves.  Persistent faults are a deterministic function
of program state (step counter, batch content, CPU set), so a replay meets
them again.

Scenarios (all take "rank" and "step"):
  grad_bitflip      flip the top exponent bit (or bit `bit`: 23, the lowest, doubles or halves the value, which
                    no detector sees) of one gradient element before its allreduce (transient); with `every`,
                    again every that many steps, each a transient of its own
  allreduce_corrupt flip the top exponent bit of one element of an allreduce output (transient)
  stall             sleep `seconds` before one collective (transient)
  lr_spike          multiply the learning rate by `factor` at `step` (persistent, params)
  bad_batch         the batch of `step` arrives with NaN loss weights in sample `sample` (default 5): corrupt
                    data; recorded as it arrived, so a replay meets it again (persistent, data)
  bad_sample        the sample in row `sample` (default 5) of the batch of `step` is corrupt in the dataset
                    itself: its loss weights are NaN whenever it is drawn again, in any epoch, on any rank
                    (the ids of the sample are the key, shared through a file) (persistent, data)
  bad_op            from `step` on, every rank divides each GELU's output by a scale that has become 0 (a
                    logic bug in an op, from finite inputs, whatever the batch) (persistent, software)
  fp32_overflow     from `step` on, every rank's GELU output x goes through x * exp(c x) / exp(c x), c =
                    `sharpness` (default 60): exp overflows float32 (not float64) for x > 1.5, and inf/inf
                    is NaN; a numerics bug, as an unstabilised softmax (persistent, software: precision)
  bad_cores         the rank pins itself to CPUs `cpus` (as a job pinning ranks to cores would); from `step`
                    on, a Linear's output is scaled by `factor` while it runs on them (persistent, device)
  segv              a native write through a null pointer (libc's memset, by ctypes) at the start of `step`:
                    SIGSEGV in native code, every time (persistent crash)
  segv_once         the same, in the live run only (a transient crash: a stray write, a machine check; the
                    replay from the last snapshot runs past it)
  slow_rank         from `step` on, sleep `ms` (default 40) in every step before its computation: a rank
                    persistently slower than its peers (a straggler; nothing is wrong with its results)
  hang_pipe         at the start of `step`'s optimizer step, read a pipe nobody writes to, every time: the rank
                    is stuck outside any collective and its peers wait inside one (persistent hang)
  hang_pipe_once    the same read, in the live run only, once (a transient hang: a peer or a filesystem that
                    never answers; the replay runs past it)
  sigkill_once      at the start of `step`'s optimizer step the rank sends itself SIGKILL, once, in the live run
                    (what the OOM killer or an operator does)
  link_reset        shut down the rank's gloo connections before one collective (transient network fault)
  net_blackhole     before one collective, every packet arriving on the rank's gloo connections is dropped
                    (a socket filter): the connections neither deliver nor reset, and the collective waits
                    with every member inside it (transient network fault; the rebuilt transport is clean)
  merge_bitflip     flip the top exponent bit of one parameter right after a recovery merge, `times`
                    merges in a row (default 1; a fault during recovery itself)
  runtime_bug       an exception inside Watcher's own batch hook (tests fail-open)

WATCHER_INJECT holds one fault or a JSON list of them (two transients in one run).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import time

import torch
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

SCENARIOS = ("grad_bitflip", "allreduce_corrupt", "stall", "link_reset", "net_blackhole", "lr_spike", "bad_batch",
             "bad_sample", "bad_op", "fp32_overflow", "bad_cores", "segv", "segv_once", "hang_pipe", "hang_pipe_once",
             "sigkill_once", "slow_rank",
             "merge_bitflip")


def _read_forever() -> None:
    """A read that never returns: a pipe whose writer never writes."""
    r, w = os.pipe()
    os.read(r, 1)


def _null_write() -> None:
    """A real native bug: libc writes through a null pointer."""
    ctypes.memset(0, 0, 8)


def _flip_top_exponent_bit(t: torch.Tensor, bit: int = 30) -> None:
    flat = t.detach().view(-1)
    if flat.dtype == torch.float32 and flat.numel():
        flat.view(torch.int32)[0] ^= 1 << bit


def _peer_connections():
    """(fd, socket) for every connected TCP socket of this process except the
    c10d store's: gloo's pairs, which the network faults below act on."""

    store_port = int(os.environ.get("MASTER_PORT", "0"))
    for name in os.listdir("/proc/self/fd"):
        try:
            s = socket.fromfd(int(name), socket.AF_INET, socket.SOCK_STREAM)
        except OSError:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6) \
                    and store_port not in (s.getpeername()[1], s.getsockname()[1]):
                yield int(name), s
        except OSError:
            pass  # not connected (a listener), or not a socket
        finally:
            s.close()


def _blackhole_connections() -> None:
    """Attach a drop-everything socket filter (classic BPF, `ret #0`) to each
    of gloo's connections: TCP never sees the peer's data or ACKs again, so
    nothing fails, everything waits."""

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(SockFilter))]

    drop = (SockFilter * 1)(SockFilter(0x06, 0, 0, 0))  # BPF_RET | BPF_K, accept 0 bytes
    prog = SockFprog(1, drop)
    libc = ctypes.CDLL(None, use_errno=True)
    for fd, _ in _peer_connections():
        libc.setsockopt(fd, socket.SOL_SOCKET, 26, ctypes.byref(prog), ctypes.sizeof(prog))  # SO_ATTACH_FILTER


def _reset_connections() -> None:
    """Shut down each of gloo's connections (so its pairs break, as on a
    network reset, and the store still works)."""

    for _, s in _peer_connections():
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def arm(rt) -> None:
    raw = os.environ.get("WATCHER_INJECT")
    if not raw:
        return
    faults = json.loads(raw)
    for f in faults if isinstance(faults, list) else [faults]:
        _arm_one(rt, f)


def _arm_one(rt, f: dict) -> None:
    kind, rank, step = f["scenario"], f.get("rank", 0), f.get("step", 0)
    fired = {"n": 0}

    def mine() -> bool:
        # Asked when the fault would fire, not now: some launchers (Lightning)
        # let a rank learn its rank only when the process group forms.
        return rt.rank == rank or kind == "lr_spike"  # a learning rate is the same on every rank

    def once() -> bool:
        if rt.mode != "live" or fired["n"] or not mine():
            return False
        fired["n"] = 1
        # Once per job, not per process: a rank resumed from a snapshot taken
        # before the fault (watcher run --rescue) must not meet it again.
        try:
            os.close(os.open(rt.rundir.drill_file(f"fired.{kind}.rank{rank}.step{step}"),
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        except FileExistsError:
            return False
        except OSError:
            pass  # no run directory to mark: once per process, as before
        return True

    if kind == "grad_bitflip":
        every, flipped = f.get("every"), set()

        def due(s: int) -> bool:
            if every:  # again every `every` steps, each a transient of its own (live only)
                return s >= step and (s - step) % every == 0 and s not in flipped
            return s == step

        def hook(rt_, op, ins):
            s = rt_.step + 1
            if op == "allreduce" and ins and due(s) and rt_.mode == "live" and mine() and (every or once()):
                flipped.add(s)
                _flip_top_exponent_bit(ins[0], f.get("bit", 30))
        rt.fault_hooks.append(("collective_input", hook))
    elif kind == "allreduce_corrupt":
        def hook(rt_, meta, outs):
            if meta["op"] == "allreduce" and meta["step"] == step and outs and once():
                _flip_top_exponent_bit(outs[0])
        rt.fault_hooks.append(("collective_output", hook))
    elif kind == "stall":
        def hook(rt_, meta):
            if meta["step"] == step and once():
                time.sleep(float(f.get("seconds", 5)))
        rt.fault_hooks.append(("before_collective", hook))
    elif kind in ("lr_spike", "segv", "segv_once", "hang_pipe", "hang_pipe_once", "sigkill_once"):

        def pre(opt, args, kwargs):
            if rt.step + 1 != step or opt is not rt.main_opt or not mine():
                return
            if kind == "segv" or kind == "segv_once" and once():
                _null_write()
            if kind == "hang_pipe" or kind == "hang_pipe_once" and once():
                _read_forever()
            if kind == "sigkill_once" and once():
                os.kill(os.getpid(), signal.SIGKILL)
            if kind != "lr_spike":
                return
            for g in opt.param_groups:
                g["lr"] = g["lr"] * float(f.get("factor", 1000.0))
        register_optimizer_step_pre_hook(pre)
    elif kind == "bad_batch":
        sample = int(f.get("sample", 5))

        def batch_hook(rt_, batch):
            # Live only: the data itself is bad, and the window records the
            # batch as it arrived, so replays are served the NaN from there.
            if rt_.step + 1 == step and isinstance(batch, (list, tuple)) and len(batch) > 2 and once():
                batch[2][sample] = float("nan")
            return batch
        rt.fault_hooks.append(("batch", batch_hook))
    elif kind == "slow_rank":
        pause = float(f.get("ms", 40)) / 1000

        def batch_hook(rt_, batch):
            # A slow device or a noisy neighbour: every step from `step` on,
            # outside any collective, live and in replay alike.
            if rt_.step + 1 >= step and mine():
                time.sleep(pause)
            return batch
        rt.fault_hooks.append(("batch", batch_hook))
    elif kind == "bad_sample":
        sample = int(f.get("sample", 5))
        key_file = rt.rundir.drill_file("bad_sample.pt")
        known = {"key": None}

        def batch_hook(rt_, batch):
            # Live only: the replays are served the corrupt sample from the record.
            if rt_.mode != "live" or not isinstance(batch, (list, tuple)) or len(batch) < 3:
                return batch
            if known["key"] is None:
                if mine() and rt_.step + 1 == step:
                    known["key"] = batch[0][sample].clone()
                    torch.save(known["key"], key_file)
                elif key_file.exists():
                    known["key"] = torch.load(key_file)
                else:
                    return batch
            for i in (batch[0] == known["key"]).all(dim=1).nonzero().flatten().tolist():
                batch[2][i] = float("nan")
            return batch
        rt.fault_hooks.append(("batch", batch_hook))
    elif kind == "bad_op":

        def fwd(module, inputs, output):
            if isinstance(module, torch.nn.GELU):
                scale = torch.tensor(1.0 if rt.step + 1 < step else 0.0)  # a schedule that reaches 0
                return output / scale
            return None
        register_module_forward_hook(fwd)
    elif kind == "fp32_overflow":

        c = float(f.get("sharpness", 60.0))

        def fwd(module, inputs, output):
            if isinstance(module, torch.nn.GELU) and rt.step + 1 >= step:
                e = torch.exp(output * c)
                return output * e / e
            return None
        register_module_forward_hook(fwd)
    elif kind == "bad_cores":

        bad = set(f.get("cpus", [0]))
        factor = float(f.get("factor", 1e4))
        pinned = {"done": False}

        def fwd(module, inputs, output):
            if not mine() or not isinstance(module, torch.nn.Linear):
                return None
            if not pinned["done"]:
                pinned["done"] = True
                os.sched_setaffinity(0, bad)
            if (rt.step + 1 >= step and set(os.sched_getaffinity(0)) <= bad
                    and getattr(module, "out_features", 0) == 256):
                return output * factor
            return None
        register_module_forward_hook(fwd)
    elif kind == "link_reset":
        def hook(rt_, meta):
            if meta["step"] == step and once():
                _reset_connections()
        rt.fault_hooks.append(("before_collective", hook))
    elif kind == "net_blackhole":
        def hook(rt_, meta):
            if meta["step"] == step and once():
                _blackhole_connections()
        rt.fault_hooks.append(("before_collective", hook))
    elif kind == "merge_bitflip":
        left = {"n": int(f.get("times", 1))}  # times=2 corrupts the retry as well

        def hook(rt_, params):
            if params and rt_.mode == "live" and left["n"] > 0 and mine():
                left["n"] -= 1
                _flip_top_exponent_bit(params[0])
        rt.fault_hooks.append(("after_merge", hook))
    elif kind == "runtime_bug":
        # Not a training fault: an exception inside Watcher's own hook, to
        # prove that Watcher then gets out of the way and training goes on.
        def boom(rt_, batch):
            if rt_.step + 1 == step and rt_.mode == "live" and mine():
                raise RuntimeError("injected failure inside a Watcher hook")
            return batch
        rt.fault_hooks.append(("batch", boom))
    else:
        raise ValueError(f"unknown scenario {kind!r}")
