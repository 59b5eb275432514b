"""The node agent: `watcher agent` (daemon.py) finds every training job on a node (discovery.py), records it into one ring, serves metrics (metrics.py) and keeps recordings (keep.py)."""
