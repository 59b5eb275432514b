"""Watcher: always-on recording, replay and diagnosis for distributed PyTorch training."""

__version__ = "0.1.0"
