"""A one-process training loop that talks to the outside world every step.

Per step it sends 8 bytes on one end of a socketpair, appends a line to a log
file, and opens a TCP connection to a listener thread in the same process that
counts connections.  A replay re-executes this code; if any of that leaked out
of the sandbox, the counts at the end would exceed the number of live steps.
At the end it writes {"bytes", "lines", "connections", "steps"} as JSON.
"""

import argparse
import json
import socket
import threading

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    a, b = socket.socketpair()
    log = open(args.out + ".log", "a", buffering=1)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    connections = []

    def accept() -> None:
        while True:
            try:
                c, _ = listener.accept()
            except OSError:
                return
            connections.append(c)

    threading.Thread(target=accept, daemon=True).start()

    x = torch.randn(512, 16)
    y = x.sum(1, keepdim=True)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)
    model = nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while step < args.steps:
        for xb, yb in loader:
            if step >= args.steps:
                break
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(xb), yb)
            loss.backward()
            opt.step()
            a.send(b"canary!!")
            log.write(f"{step} {loss.item():.6f}\n")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
            except OSError:
                pass
            step += 1
    a.close()
    received = b""
    while chunk := b.recv(4096):
        received += chunk
    log.close()
    import time
    time.sleep(0.2)  # let the acceptor take the last connection
    with open(args.out + ".log") as f:
        lines = sum(1 for _ in f)
    with open(args.out, "w") as f:
        json.dump({"bytes": len(received), "lines": lines, "connections": len(connections), "steps": step}, f)


if __name__ == "__main__":
    main()
