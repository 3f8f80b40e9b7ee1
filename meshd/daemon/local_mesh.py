"""Start several meshd daemons on loopback, each its own process: for the demo, benchmarks and tests.

Every peer listens on ports the kernel picks (port 0) and writes a ready file with its status, so
nothing here guesses at free ports. The first peer founds a private mesh and every later one joins
with an invite made by it (``open_mesh``: an open mesh, joined through the first live peer
instead). ``stop`` sends SIGTERM to
every process this object started and waits; anything still running after the grace period gets
SIGKILL. Only processes started here are ever signalled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshd.runtime.model_info import model_sizes


class LocalMeshError(RuntimeError):
    pass


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_for_ready_file(path: Path, process: subprocess.Popen[bytes], timeout: float, what: str,
                        tail: Callable[[], str]) -> dict[str, Any]:
    """The JSON a child process writes (atomically) once it listens; an error with its log's tail
    when it exits first or takes longer than ``timeout``."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise LocalMeshError(f"{what} exited with {process.returncode}:\n{tail()}")
        if time.monotonic() > deadline:
            raise LocalMeshError(f"{what} not ready after {timeout:.0f}s:\n{tail()}")
        time.sleep(0.05)
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


@dataclass
class LocalPeer:
    index: int
    process: subprocess.Popen
    data_dir: Path
    log_path: Path
    ready_file: Path
    status: dict = field(default_factory=dict)

    @property
    def control(self) -> str:
        return self.status["control"]

    @property
    def api(self) -> str:
        return self.status["api"]

    @property
    def listen(self) -> str:
        return self.status["listen"]

    @property
    def peer_id(self) -> str:
        return self.status["peer_id"]

    def get(self, path: str, timeout: float = 10.0) -> dict:
        with urllib.request.urlopen(f"http://{self.control}{path}", timeout=timeout) as resp:
            return json.loads(resp.read())

    def post(self, path: str, body: dict, timeout: float = 10.0) -> dict:
        request = urllib.request.Request(f"http://{self.control}{path}", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return json.loads(resp.read())

    def invite(self, uses: int = 1, expires_s: float = 3600.0) -> str:
        """A fresh invite token from this peer (it must hold the mesh's admission key)."""
        token: str = self.post("/invite", {"uses": uses, "expires_s": expires_s})["token"]
        return token

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)


@dataclass
class LocalRelay:
    """A ``meshd-relay`` process on loopback, with its Prometheus metrics at hand."""

    process: subprocess.Popen
    log_path: Path
    ready_file: Path
    port: int = 0
    metrics_port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics(self, timeout: float = 5.0) -> dict[str, float]:
        """Every sample as ``name{labels}`` -> value."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=timeout) as resp:
            text = resp.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)


def budgets_for_split(model_dir: Path, parts: int) -> list[int]:
    """Memory budgets that make placement split the model into ``parts`` contiguous ranges."""
    info = model_sizes(model_dir)
    base, extra = divmod(info.n_layers, parts)
    sizes = [base + (1 if i < extra else 0) for i in range(parts)]
    return [size * info.layer_bytes + info.edge_bytes + info.layer_bytes // 2 for size in sizes]


class LocalMesh:
    def __init__(self, workdir: Path, *, log_level: str = "info", env: dict[str, str] | None = None,
                 open_mesh: bool = False, link_shape: str | None = None) -> None:
        """``link_shape``: every peer started here shapes its outgoing peer traffic so (``--link-shape``)."""
        self.workdir = Path(workdir)
        self.open_mesh = open_mesh
        self.link_shape = link_shape
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_level = log_level
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
        self.peers: list[LocalPeer] = []
        self.relays: list[LocalRelay] = []

    def __enter__(self) -> LocalMesh:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start_peer(self, *, model: Path | None = None, memory_budget: int | None = None,
                   layers: tuple[int, int] | None = None, extra: list[str] | None = None,
                   bootstrap: bool = True, timeout: float = 60.0, wait: bool = True,
                   module: str = "meshd.cli.meshd_main", data_dir: Path | None = None) -> LocalPeer:
        """``module``: what ``python -m`` runs with ``meshd run``'s arguments (a test's own wrapper);
        ``data_dir``: an earlier peer's, to restart it (its identity and membership are kept there)."""
        index = len(self.peers)
        data_dir = data_dir or self.workdir / f"peer{index}"
        data_dir.mkdir(parents=True, exist_ok=True)
        ready = data_dir / "ready.json"
        ready.unlink(missing_ok=True)
        args = [sys.executable, "-m", module, "run", "--data-dir", str(data_dir),
                "--name", f"peer{index}", "--listen", "127.0.0.1:0", "--api", "127.0.0.1:0",
                "--control", "127.0.0.1:0", "--metrics", "127.0.0.1:0", "--ready-file", str(ready),
                "--log-level", self.log_level]
        if model is not None:
            args += ["--model", str(model)]
        if memory_budget is not None:
            args += ["--memory-budget", str(memory_budget)]
        if layers is not None:
            args += ["--layers", f"{layers[0]}:{layers[1]}"]
        if self.open_mesh:
            args += ["--open-mesh"]
        if self.link_shape:
            args += ["--link-shape", self.link_shape]
        live = self.live() if bootstrap else []
        if live and self.open_mesh:
            args += ["--bootstrap", live[0].listen]
        elif live:
            admitters = [p for p in live if p.status.get("admission", {}).get("admits")]
            if not admitters:
                raise LocalMeshError("no live peer holds the mesh's admission key, so no invite can be made")
            args += ["--invite", admitters[0].invite()]
        args += extra or []
        log_path = data_dir / "meshd.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                       start_new_session=True)
        peer = LocalPeer(index, process, data_dir, log_path, ready)
        self.peers.append(peer)
        if wait:
            self._wait_ready(peer, timeout)
        return peer

    def start_relay(self, *, port: int = 0, extra: list[str] | None = None, timeout: float = 30.0) -> LocalRelay:
        """A relay on loopback (``port`` 0: the kernel picks), metrics on a port of its own."""
        index = len(self.relays)
        workdir = self.workdir / f"relay{index}"
        workdir.mkdir(parents=True, exist_ok=True)
        ready = workdir / "ready.json"
        ready.unlink(missing_ok=True)
        args = [sys.executable, "-m", "meshd_relay", "--listen", f"127.0.0.1:{port}", "--metrics", "127.0.0.1:0",
                "--ready-file", str(ready), "--log-format", "text", "--log-level", self.log_level, *(extra or [])]
        log_path = workdir / "relay.log"
        with log_path.open("ab") as log:
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                       start_new_session=True)
        relay = LocalRelay(process, log_path, ready)
        self.relays.append(relay)
        ports = wait_for_ready_file(ready, process, timeout, f"relay{index}", relay.log_tail)
        relay.port, relay.metrics_port = ports["port"], ports["metrics_port"]
        return relay

    def kill_relay(self, relay: LocalRelay) -> None:
        """SIGKILL a relay this mesh started, and reap it."""
        if relay.process.poll() is None:
            relay.process.kill()
            relay.process.wait(timeout=10)

    def stop_relay(self, relay: LocalRelay, grace: float = 10.0) -> None:
        if relay.process.poll() is None:
            relay.process.send_signal(signal.SIGTERM)
            try:
                relay.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                relay.process.kill()
                relay.process.wait(timeout=5)

    def _wait_ready(self, peer: LocalPeer, timeout: float) -> None:
        peer.status = wait_for_ready_file(peer.ready_file, peer.process, timeout, f"peer{peer.index}", peer.log_tail)

    def start_peers(self, specs: list[dict], timeout: float = 90.0) -> list[LocalPeer]:
        """Start peers from keyword dicts (as for :meth:`start_peer`): the first alone, the rest together."""
        if not specs:
            return []
        first = self.start_peer(**specs[0], timeout=timeout) if not self.live() else None
        rest = specs[1:] if first is not None else specs
        pending = [self.start_peer(**spec, timeout=timeout, wait=False) for spec in rest]
        for peer in pending:
            self._wait_ready(peer, timeout)
        return ([first] if first is not None else []) + pending

    def live(self) -> list[LocalPeer]:
        return [p for p in self.peers if p.process.poll() is None]

    def wait_until(self, predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
        """Poll ``predicate`` until it returns something true; an exception it raises counts as "not
        yet" (a peer still starting, a row not there yet) and is reported if the wait times out."""
        deadline = time.monotonic() + timeout
        last_error: Exception | None = None
        while time.monotonic() < deadline:
            try:
                result = predicate()
            except Exception as exc:
                last_error = exc
            else:
                if result:
                    return result
            time.sleep(interval)
        logs = "\n".join(f"--- peer{p.index}\n{p.log_tail(15)}" for p in self.peers)
        raise LocalMeshError(f"timed out after {timeout:.0f}s waiting for {what} "
                             f"(last error: {last_error!r})\n{logs}")

    def wait_covered(self, model_id: str, timeout: float = 60.0) -> None:
        """Until every live peer sees ``model_id`` completely covered and knows every live peer."""
        live = self.live()

        def done() -> bool:
            for p in live:
                status = p.get("/status")
                if model_id not in status["models_covered"] or len(p.get("/peers")["peers"]) < len(live):
                    return False
            return True

        self.wait_until(done, timeout, f"{model_id} to be covered")

    def kill(self, peer: LocalPeer, sig: int = signal.SIGKILL) -> None:
        if peer.process.poll() is None:
            peer.process.send_signal(sig)

    def stop(self, grace: float = 10.0) -> dict[int, float]:
        """SIGTERM every running peer, then wait; returns each peer's exit time in seconds."""
        started = time.monotonic()
        for peer in self.live():
            peer.process.send_signal(signal.SIGTERM)
        exit_times: dict[int, float] = {}
        for peer in self.peers:
            remaining = max(0.1, grace - (time.monotonic() - started))
            try:
                peer.process.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                peer.process.kill()
                peer.process.wait(timeout=5)
            exit_times[peer.index] = time.monotonic() - started
        for relay in self.relays:
            self.stop_relay(relay, grace=max(0.1, grace - (time.monotonic() - started)))
        return exit_times
