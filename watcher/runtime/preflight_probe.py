"""Inside each rank under `watcher preflight`: what the launcher cannot see
from outside (batch size, dtypes, threads, DataLoader workers, a scaler, the
link's bandwidth), written to DIR/runtime/rank<r>.preflight.json.

The file is rewritten every quarter second by a thread with the memory the
rank has used so far, so a rank the OOM killer takes leaves its last reading.
After `steps` steps every rank times a few allreduces together (the link the
job will use), writes its final facts and exits with STOP_EXIT_CODE: the job
is only being tried, and never runs on past the preflight.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import torch
import torch.distributed as dist

from ..rundir import STOP_EXIT_CODE, write_json

PROBE_BYTES = 4 << 20
PROBE_ROUNDS = 5


def memory_mb() -> tuple[float | None, float | None]:
    """(resident now, peak resident) of this process, MB."""
    now = peak = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    now = int(line.split()[1]) / 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) / 1024
    except OSError:
        pass
    return now, peak


class PreflightProbe:
    def __init__(self, rt, steps: int):
        self.rt = rt
        self.steps = steps
        self.facts: dict = {"rank": rt.rank, "world": rt.world, "steps_done": 0, "done": False,
                            "local_world": int(os.environ.get("LOCAL_WORLD_SIZE", rt.world)),
                            "threads": torch.get_num_threads(), "cpus": sorted(os.sched_getaffinity(0))}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True, name="watcher-preflight").start()

    def _write(self) -> None:
        now, peak = memory_mb()
        with self.lock:
            self.facts.update(rss_mb=now, peak_rss_mb=peak)
            write_json(self.rt.rundir.preflight_file(self.rt.rank), self.facts)

    def _sample(self) -> None:
        while not self.stop.wait(0.25):
            try:
                self._write()
            except Exception:
                return

    def first_batch(self, it, batch) -> None:
        """The first batch: its size, the DataLoader's workers, the memory before any step."""
        now, _ = memory_mb()
        tensors = [t for t in (batch if isinstance(batch, (list, tuple)) else [batch]) if torch.is_tensor(t)]
        with self.lock:
            self.facts.update(base_rss_mb=now, batch=tensors[0].shape[0] if tensors and tensors[0].dim() else None,
                              dataloader_workers=getattr(it, "_num_workers", None),
                              threads=torch.get_num_threads())

    def step_ended(self, k: int) -> None:
        rt = self.rt
        params = rt.params() if rt.main_opt is not None else []
        loss = rt.last_loss
        with self.lock:
            self.facts.update(
                steps_done=k + 1,
                param_dtypes=sorted({str(p.dtype).replace("torch.", "") for p in params}),
                grad_dtypes=sorted({str(p.grad.dtype).replace("torch.", "") for p in params if p.grad is not None}),
                loss_dtype=str(loss.dtype).replace("torch.", "") if loss is not None else None,
                device=params[0].device.type if params else None,
                params=sum(p.numel() for p in params))
        if k + 1 < self.steps:
            return
        self.facts["grad_scaler"] = any(isinstance(o, torch.amp.GradScaler) for o in gc.get_objects())
        self.facts["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        if self.facts["device"] == "cuda":
            self.facts["bf16_supported"] = torch.cuda.is_bf16_supported()
            self.facts["devices"] = torch.cuda.device_count()
        self.facts["allreduce"] = self._probe_link()
        self.facts["done"] = True
        self.stop.set()
        self._write()
        rt.flush()
        os._exit(STOP_EXIT_CODE)

    def _probe_link(self) -> dict | None:
        """Allreduce bandwidth over the job's own group, every rank at once."""
        if not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        dev = "cuda" if self.facts.get("device") == "cuda" else "cpu"
        t = torch.ones(PROBE_BYTES // 4, dtype=torch.float32, device=dev)
        dist.all_reduce(t)  # a first one sets up whatever the backend sets up lazily
        times = []
        for _ in range(PROBE_ROUNDS):
            t0 = time.perf_counter()
            dist.all_reduce(t)
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        best = min(times)
        n = dist.get_world_size()
        # Bus bandwidth, the figure a link's speed is compared with: a ring
        # allreduce moves 2(n-1)/n of the buffer through each rank's link.
        return {"bytes": PROBE_BYTES, "best_s": round(best, 6), "median_s": round(sorted(times)[len(times) // 2], 6),
                "busbw_gbps": round(PROBE_BYTES * 2 * (n - 1) / n / best / 1e9 * 8, 3)}
