"""A mesh in one process: hops and an entry over an in-memory network, on Trio's (fake) clock.

Each hop is a real :class:`~meshd.session.hop.HopService` over a real shard of the model, computing
inline on the event loop so that a fake clock never jumps while a step computes. Routes come from
the real planner over offers this harness keeps, so a test decides what covers the model and when.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import trio

from meshd.runtime.host import InlineCompute, ShardHost
from meshd.runtime.model_info import ModelInfo, describe_model
from meshd.session.attempt import Speculation
from meshd.session.entry import EntryConfig, EntrySessions, Generation, PlannedRoute
from meshd.session.hop import HopService
from meshd.session.hop_state import AdmissionLimits
from meshd.session.messages import RESULTS_PATH, SEAM_PATH
from meshd.session.repair import RepairConfig
from meshd.tracker.routing import plan_route
from meshd.tracker.view import ShardOffer
from meshd.transport.memory import MemoryNetwork, MemoryOpener
from meshd.transport.streams import MessageStream
from meshd.wire.bundle import HiddenStateBundle, Sampling

ENTRY = "entry"


@dataclass
class Hop:
    peer_id: str
    address: str
    layers: tuple[int, int]
    service: HopService
    host: ShardHost
    scope: trio.CancelScope
    info: ModelInfo
    hung: bool = False  # this hop stops computing (and so answering), though its streams stay open
    claims: tuple[int, int] | None = None  # the range its offer claims, when it lies about it

    @property
    def kv_sessions(self) -> int:
        return 0 if self.host.shard is None else len(self.host.shard.kv)


@dataclass
class Routes:
    """A route source over the harness's live hops: what the tracker would plan from gossip."""

    mesh: InProcessMesh
    dead: set[str] = field(default_factory=set)          # gossip's verdict, as the entry sees it
    unreachable: list[str] = field(default_factory=list)  # what the entry reported
    demoted: dict[str, str] = field(default_factory=dict)  # peers whose offers the entry caught lying
    asked: int = 0

    async def route_for(self, model_id: str, exclude: frozenset[str] = frozenset(),
                        keep: frozenset[str] = frozenset(), avoid: frozenset[str] = frozenset(),
                        compat_key: str = "") -> PlannedRoute:
        await trio.lowlevel.checkpoint()
        self.asked += 1
        offers = [self.mesh.offer(h) for h in self.mesh.live_hops() if h.peer_id not in self.dead]
        route = plan_route(model_id, offers, lambda _p: 1.0, exclude=exclude | frozenset(self.demoted), keep=keep,
                           avoid=avoid | frozenset(self.unreachable), compat_key=compat_key)
        return PlannedRoute(route, {h.peer_id: self.mesh.hops[h.peer_id].address for h in route.hops}, "test")

    def is_alive(self, peer_id: str) -> bool:
        return peer_id not in self.dead

    def mark_unreachable(self, peer_id: str) -> None:
        self.unreachable.append(peer_id)

    def demote(self, peer_id: str, why: str) -> None:
        self.demoted[peer_id] = why


class InProcessMesh:
    def __init__(self, model_dir: Path, nursery: trio.Nursery, config: EntryConfig, step_s: float = 0.01) -> None:
        self.model_dir = model_dir
        self.step_s = step_s
        self.info: ModelInfo = describe_model(model_dir)
        self.nursery = nursery
        self.network = MemoryNetwork()
        self.hops: dict[str, Hop] = {}
        self.routes = Routes(self)
        self._entry_opener: MemoryOpener = self.network.join(ENTRY, "entry.test:1", _refuse, nursery)
        self.entry = EntrySessions(ENTRY, self._entry_opener, self.routes, config, nursery)

    def live_hops(self) -> list[Hop]:
        return [h for h in self.hops.values() if self.network.is_alive(h.peer_id) and h.host.shard is not None]

    def offer(self, hop: Hop) -> ShardOffer:
        info = hop.info
        return ShardOffer(peer_id=hop.peer_id, model_id=info.model_id, compat_key=info.compat_key,
                          n_layers=info.n_layers, layer_bytes=info.layer_bytes, edge_bytes=info.edge_bytes,
                          memory_budget_bytes=1 << 40, range=hop.claims or hop.layers,
                          active_sessions=hop.service.active_sessions)

    async def add_hop(self, name: str, layers: tuple[int, int], *, limits: AdmissionLimits | None = None,
                      kv_budget: int | None = None, compat_key: str = "", claims: tuple[int, int] | None = None) -> Hop:
        """A hop serving ``layers``; ``compat_key`` makes it claim another one (another numerics class),
        ``claims`` another range than it serves."""
        info = replace(self.info, compat_key=compat_key) if compat_key else self.info
        host = ShardHost(self.model_dir, kv_budget_bytes=kv_budget, compute=InlineCompute())
        await host.load(*layers)
        address = f"{name}.test:7700"
        hop_box: list[Hop] = []

        async def serve(stream: MessageStream) -> None:
            service = hop_box[0].service
            if stream.path == SEAM_PATH:
                await service.handle_seam(stream)
            elif stream.path == RESULTS_PATH:
                await service.handle_results(stream)
            else:
                await stream.reset()

        scope = await self.nursery.start(_hop_scope)
        opener = self.network.join(name, address, serve, scope.nursery)
        service = HopService(name, opener, host, info, limits)
        hop = Hop(name, address, layers, service, host, scope.cancel_scope, info, claims=claims)
        hop_box.append(hop)
        await scope.nursery.start(service.run)
        original = host.forward

        async def forward(bundle: HiddenStateBundle):
            if hop.hung:
                await trio.sleep_forever()
            await trio.sleep(self.step_s)  # a step takes time on the fake clock too
            return await original(bundle)

        host.forward = forward  # type: ignore[method-assign]
        self.hops[name] = hop
        return hop

    def kill(self, hop: Hop) -> None:
        """The hop's process dies: its streams break and its tasks stop, nothing said on the way out."""
        self.network.kill(hop.peer_id)
        hop.scope.cancel()

    async def generate(self, prompt: list[int], n: int, sampling: Sampling | None = None,
                       on_token: Callable[[int], Awaitable[None]] | None = None,
                       session_id: str = "s1", speculation: Speculation | None = None,
                       vocab_size: int | None = None) -> list[int]:
        """Run one generation through the entry; ``on_token(count)`` runs after each token."""
        gen = Generation(session_id=session_id, model_id=self.info.model_id, prompt=prompt, max_new_tokens=n,
                         sampling=sampling or Sampling(), stop_token_ids=frozenset(), speculation=speculation,
                         vocab_size=vocab_size)
        first = await self.routes.route_for(gen.model_id)
        tokens: list[int] = []
        stream = self.entry.generate(gen, first)
        try:
            async for token in stream:
                tokens.append(token.token)
                if on_token is not None:
                    await on_token(len(tokens))
        finally:
            await stream.aclose()  # type: ignore[attr-defined]
        return tokens

    def kv_everywhere(self) -> int:
        return sum(h.kv_sessions for h in self.hops.values() if self.network.is_alive(h.peer_id))


@dataclass
class _Scope:
    cancel_scope: trio.CancelScope
    nursery: trio.Nursery


async def _hop_scope(task_status: trio.TaskStatus[_Scope]) -> None:
    """A hop's own task tree: cancelling it is the process dying."""
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            task_status.started(_Scope(scope, nursery))
            await trio.sleep_forever()


async def _refuse(stream: MessageStream) -> None:
    await stream.reset()


def entry_config(**repair: float) -> EntryConfig:
    return EntryConfig(chunk_tokens=8, step_timeout_s=5.0, request_timeout_s=600.0,
                       repair=RepairConfig(**repair))  # type: ignore[arg-type]


@asynccontextmanager
async def in_process_mesh(model_dir: Path, config: EntryConfig | None = None) -> AsyncIterator[InProcessMesh]:
    async with trio.open_nursery() as nursery:
        yield InProcessMesh(model_dir, nursery, config or entry_config())
        nursery.cancel_scope.cancel()
