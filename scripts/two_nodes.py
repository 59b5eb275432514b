"""Two simulated nodes on one machine: network namespaces joined by a veth
pair (pyroute2), with addresses that exist only inside them and no route
out.  Used by tests/test_multinode.py and `just bench scale`.  Needs root."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pyroute2 import IPRoute, NetNS, netns

ROOT = Path(__file__).resolve().parents[1]
STEPS = 22
ADDRS = ("10.231.7.1", "10.231.7.2")


class TwoNodes:
    """Two network namespaces joined by a veth pair."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.names = [f"wn{i}-{tag}" for i in (0, 1)]
        self.ifnames = [f"wv{i}-{tag}" for i in (0, 1)]
        self.port = 20000 + os.getpid() % 20000

    def __enter__(self) -> "TwoNodes":
        try:
            for n in self.names:
                netns.create(n)
            with IPRoute() as ip:
                ip.link("add", ifname=self.ifnames[0], kind="veth", peer=self.ifnames[1])
                for i in (0, 1):
                    ip.link("set", index=ip.link_lookup(ifname=self.ifnames[i])[0], net_ns_fd=self.names[i])
            for i in (0, 1):
                with NetNS(self.names[i]) as ns:
                    ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
                    idx = ns.link_lookup(ifname=self.ifnames[i])[0]
                    ns.addr("add", index=idx, address=ADDRS[i], prefixlen=24)
                    ns.link("set", index=idx, state="up")
        except Exception:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for n in self.names:
            try:
                netns.remove(n)
            except Exception:
                pass

    def job(self, node: int, save: Path | None, steps: int = STEPS, *extra: str) -> list[str]:
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
                "--nproc_per_node=2", f"--master_addr={ADDRS[0]}", f"--master_port={self.port}",
                "-m", "watcher.workloads.ddp_lm", f"--steps={steps}", *([f"--save={save}"] if save else []), *extra]

    def start(self, node: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        """A command in the node's namespace (gloo told to use the node's link)."""
        env = dict(os.environ, GLOO_SOCKET_IFNAME=self.ifnames[node], OMP_NUM_THREADS="1")
        return subprocess.Popen(cmd, env=env, cwd=ROOT, text=True,
                                preexec_fn=lambda n=self.names[node]: netns.setns(n), **kwargs)

    def run_both(self, cmds: list[list[str]], timeout: float = 900, done=None,
                 grace: float = 60.0) -> list[subprocess.CompletedProcess]:
        """Each command in its node's namespace, at once; their results.
        Output goes to files, not pipes: a rank its launcher left behind
        holds its copies of them and would keep a pipe open for ever.  Once
        a launcher has exited (or timed out), whatever is left in its node's
        namespace is killed.  With `done` (a callable), once it holds the
        launchers get `grace` seconds more, then are stopped as at a timeout
        (what the caller needed is there; how they failed to end is in
        their stderr, with the stacks)."""
        with tempfile.TemporaryDirectory(prefix="watcher-nodes-") as d:
            files = [(open(Path(d) / f"out{i}", "w+"), open(Path(d) / f"err{i}", "w+")) for i in range(len(cmds))]
            procs = [self.start(i, cmd, stdout=files[i][0], stderr=files[i][1]) for i, cmd in enumerate(cmds)]
            deadline = time.monotonic() + timeout
            if done is not None:
                while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                    if done():
                        deadline = min(deadline, time.monotonic() + grace)
                        break
                    time.sleep(0.5)
            out = []
            for i, p in enumerate(procs):
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    # What every process of both nodes is doing, before any dies:
                    # a hang is only worth reporting with where it hung.
                    files[i][1].write(self.stacks())
                    p.kill()
                    p.wait()
                left = self.kill_left_in(i)
                so, se = (f.seek(0) or f.read() for f in files[i])
                if left:
                    se += f"\n[two_nodes: killed {left} process(es) left in node {i}'s namespace]\n"
                out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
            for pair in files:
                for f in pair:
                    f.close()
        return out

    def pids_in(self, node: int) -> list[int]:
        try:
            ns = os.stat(f"/run/netns/{self.names[node]}").st_ino
        except OSError:
            return []
        found = []
        for pid in (int(x) for x in os.listdir("/proc") if x.isdigit()):
            try:
                if os.stat(f"/proc/{pid}/ns/net").st_ino == ns:
                    found.append(pid)
            except OSError:
                pass
        return found

    def stacks(self) -> str:
        """Python and native stacks of every process in both namespaces
        (py-spy), for the report of a run that timed out."""
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        if not os.path.exists(spy):
            return "\n[two_nodes: timed out; py-spy not installed, no stacks]\n"
        out = ["\n[two_nodes: timed out; stacks of what is left]"]
        for node in (0, 1):
            for pid in self.pids_in(node):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:160]
                    dump = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True,
                                          text=True, timeout=60)
                    out.append(f"--- node {node} pid {pid}: {cmd}\n{dump.stdout[-3000:]}{dump.stderr[-300:]}")
                except (OSError, subprocess.TimeoutExpired) as e:
                    out.append(f"--- node {node} pid {pid}: no stack ({e})")
        return "\n".join(out) + "\n"

    def kill_left_in(self, node: int) -> list[int]:
        """SIGKILL every process left in the node's network namespace but
        Watcher's retained snapshots (w-snap-R, kept for `watcher diagnose`);
        their pids."""
        killed = []
        for pid in self.pids_in(node):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().startswith("w-snap-"):
                        continue
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
        return killed

    def watched(self, tmp: Path, faults, policy: str = "recover", detect: dict | None = None,
                rescue: bool = True) -> list[list[str]]:
        """`watcher run` on each node (the library API: only it injects drill faults)."""
        code = ("import json, sys; from pathlib import Path; from watcher.run import RunConfig, run; "
                "a = json.loads(sys.argv[1]); "
                "r = run(RunConfig(cmd=a['cmd'], out=Path(a['out']), policy=a['policy'], snapshot_interval=4, "
                "copy_interval=0, inject=a['faults'], detect=a['detect'], rescue=a['rescue'], quiet=True)); "
                "sys.exit(r.exit_code)")
        return [[sys.executable, "-c", code, json.dumps({"cmd": self.job(i, tmp / f"w{i}.pt"), "out": str(tmp / f"node{i}"),
                                                          "faults": faults, "policy": policy, "rescue": rescue,
                                                          "detect": detect or {}})] for i in (0, 1)]
