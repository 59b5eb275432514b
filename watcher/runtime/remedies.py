"""Prescriptions carried out in the live rank, from the step after a Track B
merge on: what the prescription changes beyond the merged state.

    adjust_params      the learning rate stays capped, gradients stay clipped
    skip_batch         the named samples stay out wherever they come back
    quarantine_device  the rank leaves the CPUs it failed on (DIR/quarantine.json says so)
"""

from __future__ import annotations

import os
import time

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..rundir import RunDir, read_json, write_json
from .training import optimizer_params


def apply(rt, prescription: dict, incident_id: str) -> None:
    p = prescription
    if p.get("action") == "adjust_params" and rt.main_opt is not None:
        opt = rt.main_opt
        caps = {c["param_group"]: c["to"] for c in p["params"] if c["name"] == "lr"}
        clip = next((c["to"] for c in p["params"] if c["name"] == "max_grad_norm"), None)

        def adjusted(o, args, kwargs):
            if o is not opt:
                return
            for i, g in enumerate(o.param_groups):
                if i in caps:
                    g["lr"] = min(g["lr"], caps[i])
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(optimizer_params(o), clip)
        register_optimizer_step_pre_hook(adjusted)
    elif p.get("action") == "skip_batch":
        # The samples stay skipped wherever they come back (a later epoch, another rank).
        rt.skip_digests |= {int(d) for b in p["batches"] for d in b.get("digests") or []}
        rt.skip_reason = incident_id
    elif p.get("action") == "quarantine_device" and p["device"]["rank"] == rt.rank:
        os.sched_setaffinity(0, p["move_to"]["cpus"])
        quarantine(rt.rundir, p["device"], incident_id)


def quarantine(run_dir: RunDir, device: dict, incident_id: str) -> None:
    """DIR/quarantine.json: devices this run stopped using, and why."""
    found = read_json(run_dir.quarantine) if run_dir.quarantine.exists() else []
    found.append(dict(device, incident_id=incident_id, ts=time.time()))
    write_json(run_dir.quarantine, found)
