"""Uprobes on the real libtorch, libcudart and libnccl (no GPU needed).

Without a GPU, cudaGetDeviceCount returns 35 (cudaErrorInsufficientDriver)
and ncclGetVersion returns 0; the recorded return codes and values must equal
what the test observed in the process itself.
"""

import glob
import json
import os
import queue
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time

import pytest

from watcher.uprobes.spec import LibrarySpec, ProbeSpec, load_specs, resolve

from .conftest import ROOT, needs_bpf, query, record, watcher

SITE = sysconfig.get_paths()["purelib"]
CUDART = (glob.glob(f"{SITE}/nvidia/cu*/lib/libcudart.so.*") or [None])[0]
NCCL = (glob.glob(f"{SITE}/nvidia/nccl/lib/libnccl.so.*") or [None])[0]
needs_libs = pytest.mark.skipif(not (CUDART and NCCL), reason="nvidia-cuda-runtime / nvidia-nccl-cu13 not installed")


def test_tensor_layout_is_measured_for_this_libtorch():
    import torch

    from watcher.uprobes.tensor_layout import cached_layout, layout_for

    lib = [l.split()[-1] for l in open("/proc/self/maps") if "libtorch_cpu" in l][0]
    layout = layout_for(lib)
    assert layout is not None and cached_layout(lib) == layout
    names = {name: size for name, size in layout["dtypes"].values()}
    assert names["float32"] == 4 and names["bfloat16"] == 2 and names["int64"] == 8
    assert torch.ones(1)._cdata  # the address the offsets are relative to


@needs_bpf
def test_gloo_collectives_recorded_with_op_and_sequence_on_both_ranks(tmp_path):
    # numel/dtype need the TensorImpl layout; measured once per libtorch and cached
    # (a recording started with a cold cache fills them in a second or two later)
    from watcher.uprobes.tensor_layout import layout_for

    assert layout_for(glob.glob(f"{SITE}/torch/lib/libtorch_cpu.so")[0]) is not None
    out = tmp_path / "coll.duckdb"
    proc = record(out, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                  str(ROOT / "tests" / "workloads" / "collectives.py"), "normal", timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = query(out, "SELECT rank, op, seq, tensor_count, numel, dtype, bytes, state FROM collective "
                      "ORDER BY rank, seq")
    t = (1, 1000, "float32", 4000)        # one tensor of 1000 float32 (the all_gather input)
    expected = [("allreduce", t)] * 5 + [("broadcast", t)] * 3 + [("allgather", t)] * 2 + \
        [("barrier", (None, None, None, None))]
    for rank in (0, 1):
        mine = [r[1:] for r in rows if r[0] == rank]
        assert mine == [(op, seq, *d, "returned") for seq, (op, d) in enumerate(expected)], rank
    assert query(out, "SELECT count(DISTINCT group_index) FROM collective") == [(1,)]
    # Each collective names the workload line that issued it, read from outside
    # the process (c10d runs with the GIL released: found by thread id).
    script = ROOT / "tests" / "workloads" / "collectives.py"
    lines = script.read_text().splitlines()
    line_of = {op: f"{script}:{lines.index(next(x for x in lines if call in x)) + 1} main"
               for op, call in (("allreduce", "dist.all_reduce(t)"), ("broadcast", "dist.broadcast(t"),
                                ("allgather", "dist.all_gather(out"), ("barrier", "dist.barrier()"))}
    sites = query(out, "SELECT c.rank, c.seq, c.op, a.py_site, a.py_stack FROM collective c "
                       "JOIN api_call a USING (api_call_id) ORDER BY c.rank, c.seq")
    assert [(r, op, site) for r, _, op, site, _ in sites] == \
        [(rank, op, line_of[op]) for rank in (0, 1) for op, _ in expected]
    # the innermost frames are torch's own wrappers around the call
    assert all("torch/distributed/" in stack.splitlines()[0] for *_, stack in sites)


OPS_SCRIPT = textwrap.dedent("""
    import sys, torch
    a = torch.ones(4, 4)
    print("ready", flush=True)
    sys.stdin.readline()              # probes attached to libtorch
    for _ in range(37):
        torch.mm(a, a)
    for _ in range(11):
        torch.add(a, a)
""")


def _attach_and_wait_for(target, out, lib, extra=()) -> tuple[subprocess.Popen, str]:
    """`watcher attach` to `target`, once it has attached `lib`'s probes:
    the recorder and its "attached N lib probes to PATH" line.  Its stderr
    is read on a thread, so a recorder that never attaches fails the test
    after 60 s instead of blocking it."""
    w = subprocess.Popen([sys.executable, "-m", "watcher.cli", "attach", "--pid", str(target.pid),
                          "--out", str(out), *extra], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in w.stderr] + [lines.put("")], daemon=True).start()
    seen = ""
    deadline = time.monotonic() + 60
    while True:
        try:
            line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        seen += line
        if line.startswith("attached") and f" {lib} probes" in line:
            return w, line.strip()
        if not line:
            break
    w.kill()
    raise AssertionError(f"{lib} probes never attached: {seen}")


@needs_bpf
def test_operator_probes_count_exact_calls(tmp_path):
    target = subprocess.Popen([sys.executable, "-c", OPS_SCRIPT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    out = tmp_path / "ops.duckdb"
    try:
        assert target.stdout.readline().strip() == "ready"
        w, _ = _attach_and_wait_for(target, out, "libtorch", ("--ops", "mm|add_Tensor"))
        target.stdin.write("go\n")
        target.stdin.flush()
        assert target.wait(60) == 0
        assert w.wait(60) == 0
    finally:
        target.kill()
    counts = dict(query(out, "SELECT symbol, count(*) FROM api_call WHERE probe = 'op' GROUP BY symbol"))
    assert counts == {"mm": 37, "add_Tensor": 11}


# Loads the libraries only after being told the recorder is running, then waits
# for the probes to be attached to them before calling anything.
LATE_LOAD = textwrap.dedent(f"""
    import ctypes, json, sys, threading
    sys.stdin.readline()                     # recorder is attached
    cudart = ctypes.CDLL({CUDART!r})
    nccl = ctypes.CDLL({NCCL!r})
    print("loaded", flush=True)
    sys.stdin.readline()                     # probes attached to both
    n = ctypes.c_int(-7)
    rc_count = cudart.cudaGetDeviceCount(ctypes.byref(n))
    v = ctypes.c_int(-7)
    rc_version = nccl.ncclGetVersion(ctypes.byref(v))
    p = ctypes.c_void_p()
    rc_malloc = cudart.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(1 << 20))
    free_rc = []
    def free_from_a_thread():
        free_rc.append(cudart.cudaFree(None))
    t = threading.Thread(target=free_from_a_thread)
    t.start()
    t.join()
    print(json.dumps({{"count_rc": rc_count, "count": n.value, "version_rc": rc_version,
                       "version": v.value, "malloc_rc": rc_malloc, "free_rc": free_rc[0]}}), flush=True)
    sys.stdin.readline()                     # lives on until its code objects were read
""")


@needs_bpf
@needs_libs
def test_cudart_and_nccl_loaded_after_attach_are_probed_with_exact_returns(tmp_path):
    target = subprocess.Popen([sys.executable, "-c", LATE_LOAD], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    out = tmp_path / "cuda.duckdb"
    w = subprocess.Popen([sys.executable, "-m", "watcher.cli", "attach", "--pid", str(target.pid),
                          "--out", str(out)], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        line = w.stderr.readline()
        assert "Ctrl-C to stop" in line, line
        target.stdin.write("go\n")
        target.stdin.flush()
        assert target.stdout.readline().strip() == "loaded"
        attached = set()
        deadline = time.monotonic() + 30
        while attached != {"libcudart", "libnccl"} and time.monotonic() < deadline:
            line = w.stderr.readline()
            for lib in ("libcudart", "libnccl"):
                if line.startswith("attached") and f" {lib} probes" in line:
                    attached.add(lib)
        assert attached == {"libcudart", "libnccl"}
        target.stdin.write("go\n")
        target.stdin.flush()
        truth = json.loads(target.stdout.readline())
        time.sleep(1.0)  # the collector reads new code objects at its next ring poll (every 0.1 s)
        target.stdin.write("go\n")
        target.stdin.flush()
        assert target.wait(30) == 0
        assert w.wait(60) == 0
    finally:
        target.kill()
        w.kill()
    assert truth["count_rc"] == 35 and truth["version_rc"] == 0
    rows = {r[0]: r[1:] for r in query(out, "SELECT probe, ret, ret_name, deref, library FROM api_call")}
    assert rows["cudaGetDeviceCount"] == (35, "cudaErrorInsufficientDriver", truth["count"], "libcudart")
    assert rows["ncclGetVersion"] == (0, "ncclSuccess", truth["version"], "libnccl")
    assert rows["cudaMalloc"][0] == truth["malloc_rc"]
    [(detail,)] = query(out, "SELECT detail FROM api_call WHERE probe = 'cudaMalloc'")
    assert "size=1048576" in detail
    assert rows["cudaFree"][0] == truth["free_rc"]
    assert query(out, "SELECT call, error, failed FROM cuda_call ORDER BY ts") == [
        ("cudaGetDeviceCount", "cudaErrorInsufficientDriver", True),
        ("cudaMalloc", "cudaErrorInsufficientDriver", True),
        ("cudaFree", rows["cudaFree"][1], truth["free_rc"] != 0)]
    assert query(out, "SELECT call, result, failed FROM nccl_call") == [("ncclGetVersion", "ncclSuccess", False)]
    # Each call carries the Python line that made it (`python -c`: file "<string>").
    script = LATE_LOAD.splitlines()
    line = {call: 1 + next(i for i, x in enumerate(script) if f".{call}(" in x) for call in
            ("cudaGetDeviceCount", "ncclGetVersion", "cudaMalloc")}
    stacks = dict(query(out, "SELECT probe, py_stack FROM api_call"))
    assert {p: stacks[p] for p in line} == {p: f"<string>:{n} <module>" for p, n in line.items()}
    # A call from another thread carries that thread's stack (found by its thread id), not the main one's.
    free_line = 1 + next(i for i, x in enumerate(script) if "cudart.cudaFree(" in x)
    assert stacks["cudaFree"].splitlines()[0] == f"<string>:{free_line} free_from_a_thread"
    assert stacks["cudaFree"].splitlines()[1].endswith(" Thread.run")


# Runs in its own mount namespace, where the library sits at a path that on
# the recorder's side is an empty directory: a container's copy.
IN_CONTAINER = textwrap.dedent("""
    import ctypes, sys
    cudart = ctypes.CDLL(sys.argv[1])
    print("loaded", flush=True)
    sys.stdin.readline()                     # probes attached
    n = ctypes.c_int(-7)
    rcs = [cudart.cudaGetDeviceCount(ctypes.byref(n)) for _ in range(3)]
    print(",".join(map(str, rcs)), flush=True)
    sys.stdin.readline()
""")


@needs_bpf
@needs_libs
def test_a_containers_own_copy_of_a_library_is_probed_through_its_root(tmp_path):
    """The target maps /…/mnt/libcudart.so.12, which exists only inside its
    mount namespace (bind-mounted there); on this side that directory is
    empty.  The probes must go on the file the target mapped, reached
    through /proc/PID/root, and rows must name the target's path."""
    lib_dir, mnt = tmp_path / "image", tmp_path / "mnt"
    lib_dir.mkdir()
    mnt.mkdir()
    (lib_dir / "libcudart.so.12").write_bytes(open(CUDART, "rb").read())  # its own inode, not the venv's
    lib = f"{mnt}/libcudart.so.12"
    target = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'mount --bind "{lib_dir}" "{mnt}" && exec "$0" -c "$1" "$2"', sys.executable, IN_CONTAINER, lib],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out = tmp_path / "ns.duckdb"
    w = None
    try:
        assert not os.path.exists(lib)  # not on this side
        assert target.stdout.readline().strip() == "loaded"
        w, line = _attach_and_wait_for(target, out, "libcudart")
        assert line.endswith(f"libcudart probes to {lib}"), line
        target.stdin.write("go\n")
        target.stdin.flush()
        rcs = [int(x) for x in target.stdout.readline().split(",")]
        target.stdin.write("go\n")
        target.stdin.flush()
        assert target.wait(30) == 0
        assert w.wait(60) == 0
    finally:
        target.kill()
        if w is not None:
            w.kill()
    assert rcs == [35, 35, 35]
    assert query(out, "SELECT probe, ret, file, count(*) FROM api_call GROUP BY ALL") == [
        ("cudaGetDeviceCount", 35, lib, 3)]


@needs_libs
def test_spec_errors_are_reported_not_silent():
    lib = [s for s in load_specs() if s.library == "libcudart"][0]
    bogus = ProbeSpec("libcudart", "nope", "cudaNoSuchFunction", None, (), "int", None, True, "libcudart", None, False)
    pattern = ProbeSpec("libcudart", "pat", None, r"^zzzNothing\(", (), "int", None, True, "libcudart", None, False)
    found, missing = resolve(LibrarySpec("libcudart", lib.file_pattern, (bogus, pattern)), CUDART)
    assert found == []
    assert missing == [f"nope: symbol cudaNoSuchFunction not in {CUDART}",
                       f"pat: 0 functions matched '^zzzNothing\\\\(' in {CUDART}"]


@needs_bpf
def test_ops_pattern_matching_nothing_is_reported(tmp_path):
    out = tmp_path / "none.duckdb"
    proc = record(out, sys.executable, "-c", "import torch; torch.ones(1)", extra=("--ops", "zz_no_such_op"))
    assert proc.returncode == 0, proc.stderr
    assert "warning: op: 0 functions matched" in proc.stderr
    meta = dict(query(out, "SELECT key, value FROM meta"))
    assert "0 functions matched" in meta["probe_warnings"]


def test_every_spec_loads_and_names_known_types():
    specs = {s.library: s for s in load_specs()}
    assert set(specs) == {"libtorch", "libtorch_cuda", "libcudart", "libnccl"}
    names = {p.name for s in specs.values() for p in s.probes}
    for want in ("cudaLaunchKernel", "cudaMemcpyAsync", "cudaStreamSynchronize", "ncclAllReduce",
                 "ncclCommInitRank", "ncclCommAbort", "ncclGroupStart", "gloo.allreduce", "gloo.barrier", "op",
                 "nccl.allreduce"):
        assert want in names, want


def test_python_frame_layout_and_line_table_match_this_interpreter():
    """The offsets the BPF handler walks, checked against the running
    interpreter; the line-table decoder against CPython's own positions."""
    import types

    from watcher.uprobes.python_frames import addr_to_line, check_layout, user_frame

    assert check_layout() is None
    # the user's line: past the standard library, installed packages and Watcher's own hooks
    stdlib = os.path.dirname(json.__file__).rsplit("/", 1)[0]
    assert user_frame([f"{stdlib}/threading.py:975 Thread.run", "<string>:5 f"]) == "<string>:5 f"
    assert user_frame([f"{ROOT}/watcher/runtime/rank.py:640 backward",
                       f"{ROOT}/watcher/workloads/ddp_lm.py:171 main"]) == f"{ROOT}/watcher/workloads/ddp_lm.py:171 main"
    assert user_frame([f"{SITE}/torch/distributed/c10d.py:1 all_reduce", "<frozen runpy>:88 _run_code"]) is None
    assert user_frame(["/usr/lib64/python3.11/contextlib.py:81 inner", "..."]) is None  # a stack cut at 32 frames

    def codes(co):
        yield co
        for c in co.co_consts:
            if isinstance(c, types.CodeType):
                yield from codes(c)

    n = 0
    for mod in (json, textwrap, subprocess):
        for co in codes(compile(open(mod.__file__).read(), mod.__file__, "exec")):
            for unit, (line, *_) in enumerate(co.co_positions()):
                assert addr_to_line(co.co_linetable, co.co_firstlineno, 2 * unit) == line, (co, unit)
                n += 1
    assert n > 10_000


def load_and_call(cudart: str, nccl: str, init: bool = False) -> str:
    """A script that loads CUDA's runtime and calls cudaGetDeviceCount 5 times
    at once, then NCCL's ncclGetVersion (and ncclCommInitRank with `init`),
    and prints what each returned."""
    return textwrap.dedent(f"""
        import ctypes, json
        cudart = ctypes.CDLL({cudart!r})
        n = ctypes.c_int(-7)
        rcs = [cudart.cudaGetDeviceCount(ctypes.byref(n)) for _ in range(5)]
        nccl = ctypes.CDLL({nccl!r})
        v = ctypes.c_int(-7)
        got = {{"rcs": rcs, "version_rc": nccl.ncclGetVersion(ctypes.byref(v)), "version": v.value}}
        if {init!r}:
            class UniqueId(ctypes.Structure):  # ncclUniqueId, passed by value
                _fields_ = [("internal", ctypes.c_char * 128)]
            comm = ctypes.c_void_p()
            got["init_rc"] = nccl.ncclCommInitRank(ctypes.byref(comm), 1, UniqueId(), 0)  # no GPU: an error code
        print(json.dumps(got))
    """)


@needs_bpf
@needs_libs
def test_calls_right_after_a_load_are_recorded_from_the_first(tmp_path):
    """A recorded command that loads CUDA's runtime and NCCL and calls them at
    once, with no wait: every call is recorded, because the libraries its
    Python can load were probed before it started (uprobes/preattach.py)."""
    script = load_and_call(CUDART, NCCL)
    out = tmp_path / "first.duckdb"
    p = record(out, sys.executable, "-c", script)
    assert p.returncode == 0, p.stderr
    truth = json.loads(p.stdout.strip().splitlines()[-1])
    assert truth["rcs"] == [35] * 5
    rows = query(out, "SELECT probe, ret, deref FROM api_call ORDER BY ts")
    assert rows == [("cudaGetDeviceCount", 35, -7)] * 5 + [("ncclGetVersion", 0, truth["version"])]


@needs_bpf
@needs_libs
def test_a_library_found_only_at_its_load_is_held_until_probed(tmp_path):
    """Copies of CUDA's runtime and NCCL in a directory no search path names
    (new files: the copies in site-packages are probed ahead, these cannot
    be), loaded and called at once: the load is held until the probes are on
    (uprobes/hold.c), so every call is recorded."""
    import shutil

    libs = tmp_path / "found-late"
    libs.mkdir()
    cudart, nccl = shutil.copy(CUDART, libs), shutil.copy(NCCL, libs)
    script = load_and_call(cudart, nccl, init=True)
    out = tmp_path / "held.duckdb"
    p = record(out, sys.executable, "-c", script)
    assert p.returncode == 0, p.stderr
    truth = json.loads(p.stdout.strip().splitlines()[-1])
    assert truth["rcs"] == [35] * 5
    assert truth["init_rc"] != 0
    rows = query(out, "SELECT probe, ret, deref FROM api_call ORDER BY ts")
    assert rows[:6] == [("cudaGetDeviceCount", 35, -7)] * 5 + [("ncclGetVersion", 0, truth["version"])]
    assert [(probe, ret) for probe, ret, _ in rows[6:]] == [("ncclCommInitRank", truth["init_rc"])]  # NCCL's init
    assert f"probes to {cudart}" in p.stderr and f"probes to {nccl}" in p.stderr
    [(held,)] = query(out, "SELECT value FROM meta WHERE key = 'held_loads'")
    assert int(held) == 2


@needs_libs
def test_a_held_load_goes_on_when_watcher_never_answers(tmp_path):
    """Fail open: the audit module waits at most its timeout for an answer,
    then the load goes on (no privileges needed: no probes here)."""
    import socket

    from watcher.uprobes.hold import SOURCE
    from watcher.runtime import native

    module = native.build(SOURCE, ["-shared", "-fPIC", "-O2"], tmp_path)
    assert module is not None
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mute.bind(str(tmp_path / "sock"))
    mute.listen(8)  # accepts (the kernel queues the connection), never answers
    env = dict(os.environ, LD_AUDIT=str(module), WATCHER_HOLD_LIBS="libcudart", WATCHER_HOLD_TIMEOUT_MS="300",
               WATCHER_HOLD_SOCK=str(tmp_path / "sock"))
    script = f"import ctypes, time; t = time.monotonic(); ctypes.CDLL({CUDART!r}); print(time.monotonic() - t)"
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    mute.close()
    assert p.returncode == 0, p.stderr
    assert 0.3 <= float(p.stdout) < 5  # held for the timeout, then let go
