"""`pdcluster worker`: one pod of an instance of a role — its ranks, and on
the leader pod the engine's HTTP server.

Process layout of an instance with dp × cp × tp × pp ranks over P pods
(`gpusPerPod`, runtime/pod_layout.py: pod k hosts global ranks [k*G, (k+1)*G)):
- on pod 0 (the leader, the only pod when gpusPerPod is left out) this
  process is global rank 0: the leader of dp group 0, the HTTP server
  (and, for prefill, the bootstrap server); the pod's other ranks are child
  processes started here;
- on pod k > 0 this process only starts and watches the pod's ranks; they
  wait for the leader's address (runtime/leader_address.py) and join their
  group's torch store after proving the cluster token (pod_rendezvous.py);
- each dp group is its own torch.distributed world (dp groups never run a
  collective together), so a group's ranks are `cp × tp × pp` processes;
  the leader of group d > 0 serves an internal HTTP port the front (group
  0) relays its rooms to. Its store and that port live on the pod of the
  group's rank 0: loopback when that is pod 0, else the pod's own address
  (token required), which the pod publishes in the leader pod's address
  directory before its ranks start (`_with_group_hosts`). Ports:
  runtime/dp_ports.py.

The process exits non-zero when a rank dies: an instance is a gang, its
peers cannot continue alone (the launcher or Kubernetes restarts it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import uvicorn

from pdcluster.runtime.cluster_token import read_cluster_token
from pdcluster.runtime.dp_ports import DpPorts, DpPortsError, parse_port_list, resolve_dp_ports
from pdcluster.runtime.http import event_loop
from pdcluster.runtime.http.event_loop import DEFAULT_EVENT_LOOP, EventLoop
from pdcluster.runtime.pd.peer_address import BootstrapAddress
from pdcluster.runtime.pod_layout import PodLayout
from pdcluster.runtime.pod_rendezvous import (
    PodPlan,
    RankIdentity,
    RendezvousError,
    group_hosts,
    plan_pod,
)
from pdcluster.runtime.spec import (
    DRAIN_MARGIN_SECONDS,
    PDCluster,
    Role,
    RoleSpec,
    TransferBackend,
    WorkerApiAccess,
)

log = logging.getLogger("pdcluster.worker")

# Fault injection for tests only: "<role>:<step>:<seconds>" makes that
# role's engine block for <seconds> in its <step>-th step (a hung step).
HANG_ENV = "PDCLUSTER_TEST_HANG_STEP"


@dataclass(frozen=True)
class WorkerSettings:
    """What one rank process needs to start (picklable: handed to children)."""

    manifest: PDCluster
    role: Role
    instance: int
    host: str
    advertise_host: str
    port: int
    dist_port: int  # dp group 0's torch.distributed store (the others: dp_dist_ports)
    bootstrap_port: int | None
    token: str
    shm_dir: str | None
    # HTTP ports of the leaders of dp groups 1..dp-1 (internal, on 127.0.0.1) and
    # the torch store ports of those groups (runtime/dp_ports.py says who picks them).
    dp_ports: tuple[int, ...] = ()
    dp_dist_ports: tuple[int, ...] = ()
    # A directory with tokenizer.json to use instead of the model's own.
    tokenizer: str | None = None
    # Decode: the prefill bootstrap servers it may contact, when given at start
    # (local mode); None waits for `PUT /admin/prefill_peers` (Kubernetes).
    prefill_peers: frozenset[BootstrapAddress] | None = None
    # The HTTP servers' event loop (PDCLUSTER_EVENT_LOOP, http/event_loop.py).
    event_loop: EventLoop = DEFAULT_EVENT_LOOP
    # The pod of a multi-pod instance this process runs (0: the leader).
    pod_index: int = 0
    # The leader pod's address (pods k > 0); None: this pod is the leader.
    leader_host: str | None = None
    # Multi-pod dp > 1: where each dp group's leader (its store, its internal
    # HTTP server) is reached from this pod (None: a group this pod does not
    # need); learnt from the leader pod's address directory (pod_rendezvous.py).
    group_hosts: tuple[str | None, ...] = ()

    @property
    def role_spec(self) -> RoleSpec:
        rs = self.manifest.spec.role_spec(self.role)
        assert rs is not None, f"manifest has no {self.role} role"
        return rs

    @property
    def layout(self) -> PodLayout:
        return self.role_spec.pod_layout

    @property
    def leader_advertise_host(self) -> str:
        """Where the instance's leader pod is reached (its bootstrap server, its store)."""
        return self.leader_host or self.advertise_host

    def group_store_host(self, dp_rank: int) -> str:
        """Where dp group `dp_rank`'s torch store is dialled (hosted by its rank 0)."""
        if self.group_hosts and self.group_hosts[dp_rank] is not None:
            return self.group_hosts[dp_rank]  # type: ignore[return-value]
        return store_host(self.leader_advertise_host, self.layout.is_multi_pod)

    def leads_on_front_pod(self, dp_rank: int) -> bool:
        """Whether dp group `dp_rank`'s leader runs on pod 0, next to the HTTP front."""
        topo = self.role_spec.topology
        return self.layout.pod_of_rank(dp_rank * topo.cp * topo.tp * topo.pp) == 0

    def dp_http_host(self, dp_rank: int) -> str:
        """Where dp group `dp_rank` (> 0)'s leader serves its internal HTTP API: loopback
        next to the front, else the hosting pod's own address (token required)."""
        return self._front_loopback if self.leads_on_front_pod(dp_rank) else self.host

    @property
    def _front_loopback(self) -> str:
        # As for the store: a loopback advertise host (pods sharing one network
        # on the test node agent, 127.0.x.y each) is kept so pods do not collide.
        return store_host(self.leader_advertise_host)

    @property
    def dp_urls(self) -> tuple[str, ...]:
        """http://host:port of the leaders of dp groups 1..dp-1, as the front reaches them."""
        urls = []
        for d, port in enumerate(self.dp_ports, start=1):
            host = self._front_loopback
            if not self.leads_on_front_pod(d):
                remote = self.group_hosts[d] if self.group_hosts else None
                assert remote is not None, f"dp group {d}'s leader pod address is unknown"
                host = remote
            urls.append(f"http://{_url_host(host)}:{port}")
        return tuple(urls)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _torch_threads() -> int:
    # One intra-op thread per rank by default: ranks of an instance share the
    # host's cores, and oversubscribed torch threads slow everything down.
    return max(1, int(os.environ.get("PDCLUSTER_TORCH_THREADS", "1")))


def engine_config(settings: WorkerSettings, dp_rank: int, group_rank: int = 0) -> Any:
    from pdcluster.runtime.engine.engine_config import engine_config_from_spec
    from pdcluster.runtime.engine.model_dir import ModelDirError, resolve_model_dir
    from pdcluster.runtime.engine.topology import ParallelConfig

    shm_dir = None
    if settings.shm_dir is not None:
        shm_dir = os.path.join(settings.shm_dir, f"dp{dp_rank}")
        os.makedirs(shm_dir, exist_ok=True)
    try:
        model_dir = resolve_model_dir(settings.manifest.spec.model, os.environ)
    except ModelDirError as err:
        raise SystemExit(f"pdcluster worker: {err}") from None
    cfg = engine_config_from_spec(settings.manifest.spec, settings.role_spec, shm_dir, model_dir)
    topo = settings.role_spec.topology
    placement = _place_rank(settings, dp_rank * topo.cp * topo.tp * topo.pp + group_rank)
    # One torch world per dp group: see the module docstring.
    return replace(
        cfg,
        device=placement.device,
        parallel=ParallelConfig(dp=1, cp=topo.cp, tp=topo.tp, pp=topo.pp),
    )


def _place_rank(settings: WorkerSettings, global_rank: int) -> Any:
    """This rank's GPU and NIC (engine/rank_placement.py); its UCX_NET_DEVICES is set
    here, in the rank's own process, before its NIXL agent exists."""
    from pdcluster.runtime.engine.rank_placement import RankPlacementError, place_rank

    device = settings.role_spec.device
    visible = 0
    if device == "cuda":
        import torch

        visible = torch.cuda.device_count()
    try:
        placement = place_rank(
            settings.layout, global_rank, device, visible, settings.manifest.spec.transfer.ucx
        )
    except RankPlacementError as err:
        raise SystemExit(f"pdcluster worker: rank {global_rank}: {err}") from None
    if placement.ucx_net_devices is not None:
        os.environ["UCX_NET_DEVICES"] = placement.ucx_net_devices
    return placement


def _init_group(
    settings: WorkerSettings,
    dp_rank: int,
    group_rank: int,
    on_waiting: Callable[[list[int]], None] | None = None,
) -> Any:
    from pdcluster.runtime.engine.parallel import init_distributed
    from pdcluster.runtime.engine.rendezvous import RankGate

    cfg = engine_config(settings, dp_rank, group_rank)
    if cfg.parallel.world_size == 1:
        return cfg, None
    # dp group 0's rank 0 on the leader pod of a multi-pod dp > 1 instance
    # hosts the address directory already: its store is that one.
    store = _DIRECTORY[0] if dp_rank == 0 and group_rank == 0 and _DIRECTORY else None
    gate = RankGate(
        token=settings.token,
        identity=RankIdentity(
            settings.manifest.metadata.name, settings.role.value, settings.instance
        ),
        offset=dp_rank * cfg.parallel.world_size,
        on_waiting=on_waiting,
    )
    dist = init_distributed(
        cfg.parallel,
        group_rank,
        settings.group_store_host(dp_rank),
        settings.dist_port if dp_rank == 0 else settings.dp_dist_ports[dp_rank - 1],
        cfg.device,
        gate=gate,
        store=store,
    )
    return cfg, dist


def store_host(leader_host: str, is_multi_pod: bool = False) -> str:
    """Where the torch.distributed store of an instance is dialled.

    The store is unauthenticated and its object exchange unpickles, so a
    one-pod instance keeps it off the pod network: loopback (a loopback
    advertise host, the test node agent's 127.0.x.y pods sharing one
    network, is kept so pods do not collide). A multi-pod instance has no
    choice: its ranks meet at the leader pod's address, behind the token
    gate (engine/rendezvous.py) and the NetworkPolicy.
    """
    if is_multi_pod or leader_host.startswith("127."):
        return leader_host
    return "127.0.0.1"


def configure_worker_logging(settings: WorkerSettings) -> None:
    """Every process of a worker logs in the manifest's format (`telemetry/request_log.py`)."""
    from pdcluster.runtime.telemetry.request_log import configure_logging, log_format_of

    fmt = log_format_of(settings.manifest.spec.observability.log_format, os.environ)
    configure_logging(
        fmt,
        role=settings.role.value,
        instance=f"{settings.role.value}-{settings.instance}",
        cluster=settings.manifest.metadata.name,
    )


def follower_main(settings: WorkerSettings, dp_rank: int, group_rank: int) -> None:
    """Entry of a non-leader rank: run the forward passes the leader plans."""
    import torch

    from pdcluster.runtime.engine.runner import ModelRunner, run_follower

    torch.set_num_threads(_torch_threads())
    configure_worker_logging(settings)
    # A follower has nothing to drain and its group cannot go on without it:
    # it ends when its leader shuts the group down after the leader's drain
    # (a StepPlan with shutdown), never on a stop signal that reached the whole
    # process group (the leader finishes its requests first). Its pod process
    # kills it if the leader never does (_run_pod).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg, dist = _init_group(settings, dp_rank, group_rank)
    runner = ModelRunner.build(cfg, dist)
    agent = _attach_rank_agent(settings, runner, dp_rank, group_rank, leader=False)
    try:
        run_follower(runner)
    finally:
        if agent is not None:
            agent.close()


def _attach_rank_agent(
    settings: WorkerSettings, runner: Any, dp_rank: int, group_rank: int, leader: bool
) -> Any:
    """PD roles: the per-rank transfer agent (None when colocated)."""
    if settings.role is Role.colocated:
        return None
    from pdcluster.runtime.pd_worker.startup import start_rank_agent

    return start_rank_agent(settings, runner, dp_rank, group_rank, leader)


def _start_children(
    settings: WorkerSettings, ranks: Iterable[int]
) -> list[multiprocessing.process.BaseProcess]:
    """One process per global rank in `ranks` (rank 0, this process on the leader, excluded)."""
    topo = settings.role_spec.topology
    group = topo.cp * topo.tp * topo.pp
    ctx = multiprocessing.get_context("spawn")
    children: list[multiprocessing.process.BaseProcess] = []
    for rank in ranks:
        if rank == 0:
            continue  # the leader process itself
        dp_rank, group_rank = divmod(rank, group)
        target = follower_main if group_rank else dp_leader_main
        p = ctx.Process(
            target=target,
            args=(settings, dp_rank, group_rank),
            daemon=False,
            name=f"rank-{rank}",
        )
        p.start()
        children.append(p)
    return children


def dp_leader_main(settings: WorkerSettings, dp_rank: int, group_rank: int) -> None:
    """Leader of dp group d > 0: its own engine and an internal HTTP port."""
    configure_worker_logging(settings)
    host = settings.dp_http_host(dp_rank)
    if not host.startswith("127.") and not settings.token:
        raise SystemExit(
            f"pdcluster worker: dp group {dp_rank}'s leader would serve {host} without a "
            "cluster token; set PDCLUSTER_TOKEN"
        )
    serve_leader(settings, dp_rank, port=settings.dp_ports[dp_rank - 1], host=host)


def serve_leader(settings: WorkerSettings, dp_rank: int, port: int, host: str) -> None:
    import torch

    from pdcluster.runtime.engine.runner import ModelRunner

    torch.set_num_threads(_torch_threads())
    starting = None
    if dp_rank == 0 and settings.layout.is_multi_pod:
        # The worker API needs every rank; until they joined, say which are missing.
        from pdcluster.runtime.starting_server import StartingServer

        starting = StartingServer(host, port, settings.layout)
        starting.start()
    try:
        cfg, dist = _init_group(
            settings, dp_rank, 0, starting.set_missing if starting is not None else None
        )
        runner = ModelRunner.build(cfg, dist)
        agent = _attach_rank_agent(settings, runner, dp_rank, 0, leader=True)
    finally:
        if starting is not None:
            starting.close()
    _serve_engine(settings, dp_rank, port, host, cfg, dist, runner, agent)


def _serve_engine(
    settings: WorkerSettings,
    dp_rank: int,
    port: int,
    host: str,
    cfg: Any,
    dist: Any,
    runner: Any,
    agent: Any,
) -> None:
    from pdcluster.runtime.engine.engine import LLMEngine
    from pdcluster.runtime.engine.tokenizer import load_tokenizer
    from pdcluster.runtime.http.limits import server_config
    from pdcluster.runtime.metrics import WorkerMetrics
    from pdcluster.runtime.server.worker_app import WorkerInfo, WorkerState, create_worker_app
    from pdcluster.runtime.serving.engine_service import EngineService

    engine: Any = LLMEngine(cfg, runner=runner, dist=dist)
    tokenizer = load_tokenizer(settings.tokenizer or cfg.model, engine.model_config.eos_token_id)
    hang = os.environ.get(HANG_ENV)
    if hang:
        from pdcluster.runtime.engine.hang import hang_at_step

        engine = hang_at_step(engine, settings.role, hang)
    service = EngineService(
        engine, tokenizer, stall_s=settings.role_spec.engine.stall_timeout_seconds
    )
    if agent is not None:
        # A hung engine thread fails nothing itself: the agent fails its rooms
        # (prefill: decode sees the verdict at once) while the watchdog ends
        # the tracked requests.
        service.stall_hooks.append(lambda: agent.fail_all_rooms("engine_stalled"))
    from pdcluster.runtime.telemetry.tracing import start_tracing

    name = settings.manifest.metadata.name
    instance = f"{settings.role.value}-{settings.instance}"
    metrics = WorkerMetrics(settings.role, cluster=name, instance=instance)
    tracing = start_tracing(
        settings.manifest.spec.observability.tracing,
        f"pdcluster-{settings.role.value}",
        {
            "pdcluster.cluster": name,
            "pdcluster.role": settings.role.value,
            "pdcluster.instance": instance,
        },
    )
    metrics.watch_pages(lambda: engine.num_free_pages, lambda: engine.num_total_pages)
    metrics.engine_stalled.set_function(lambda: 1.0 if service.is_stalled else 0.0)
    metrics.watch_prefix_cache(lambda: engine.prefix_cache_stats())
    model = settings.manifest.spec.model
    info = WorkerInfo(
        model_name=model.name,
        model_path=model.path or model.name,
        max_prompt_tokens=cfg.max_prompt_tokens,
        max_new_tokens=cfg.max_new_tokens,
        vocab_size=engine.model_config.vocab_size,
        extra={
            "dp_size": settings.role_spec.topology.dp,
            "dp_rank": dp_rank,
            "instance": settings.instance,
            "page_size": cfg.page_size,
            # Every rank of every pod joined before this server started.
            "num_pods": settings.layout.num_pods,
            "ranks_per_pod": settings.layout.ranks_per_pod,
            "missing_ranks": [],
        },
    )
    extra_routes = None
    servers: list[uvicorn.Server] = []
    if settings.role is Role.colocated:
        from pdcluster.runtime.server.colocated import ColocatedBackend

        backend: Any = ColocatedBackend(service)
    else:
        from pdcluster.runtime.pd_worker.backends import build_pd_backend

        backend, extra_routes, extra_servers = build_pd_backend(
            settings, service, agent, metrics, dp_rank
        )
        servers.extend(extra_servers)
    extra_routes = _with_prefix_feed(engine, cfg, tokenizer, settings, extra_routes)
    auth = settings.manifest.spec.auth  # workerApi: open lets a keyless PD router in
    app = create_worker_app(
        backend,
        tokenizer,
        info,
        metrics,
        token=settings.token,
        # Only the front opens up: a dp leader behind it takes the front's relays,
        # which always carry the cluster token.
        data_plane_open=auth.worker_api is WorkerApiAccess.open and dp_rank == 0,
        extra_routes=extra_routes,
        tracing=tracing,
    )
    servers.insert(0, uvicorn.Server(server_config(app, host, port)))
    state: WorkerState = app.state.worker
    service.start()
    try:
        event_loop.run(
            _serve_all(servers, announce_seconds(settings, os.environ), state.announce_stop),
            settings.event_loop,
        )
    finally:
        if tracing is not None:
            tracing.shutdown()
        service.stop()
        if agent is not None:
            agent.close()
        engine.shutdown()


def _with_prefix_feed(
    engine: Any, cfg: Any, tokenizer: Any, settings: WorkerSettings, routes: Any
) -> Any:
    """With the prefix cache on (and one dp group: routers reach only this
    process), publish its page keys at /prefix_cache/* (`server/prefix_feed.py`)."""
    from pdcluster.runtime.engine.caching_allocator import CachingPageAllocator

    allocator = getattr(engine, "allocator", None)
    if not isinstance(allocator, CachingPageAllocator) or settings.role_spec.topology.dp != 1:
        return routes
    import secrets

    from pdcluster.runtime.prefix_events import KeyEventLog
    from pdcluster.runtime.server.prefix_feed import PrefixFeed, add_prefix_feed_routes

    feed = PrefixFeed(
        KeyEventLog(
            secrets.token_hex(8),
            salt=cfg.prefix_cache_salt(engine.model_config),
            page_size=cfg.page_size,
            tokenizer=tokenizer.fingerprint,
        )
    )
    allocator.subscribe(feed.record)

    def add(app: Any) -> None:
        if routes is not None:
            routes(app)
        add_prefix_feed_routes(app, feed)

    return add


def announce_seconds(settings: WorkerSettings, env: Mapping[str, str]) -> float:
    """How long a stopping worker stays Not Ready but serving before its drain: the
    role's `drain.announceSeconds` in a Kubernetes pod, where routers learn of the
    pod's deletion from a watch while the kubelet signals it; 0 in local mode,
    which stops a worker only after its router let it go (`local/drain.py`) or
    with the whole cluster."""
    if not env.get("KUBERNETES_SERVICE_HOST"):
        return 0.0
    return settings.role_spec.drain.announce_seconds


async def _serve_all(
    servers: list[uvicorn.Server],
    announce_s: float = 0.0,
    announce: Callable[[], bool] | None = None,
) -> None:
    """Serve the worker API (`servers[0]`) and its side servers until SIGTERM/SIGINT.

    Stopping drains: the worker API stops accepting, finishes what it has in
    flight, and only then do the side servers stop. A prefill's bootstrap
    server must outlive the drain, because decode's heartbeats probe it and
    would fail the rooms of the very requests being drained.

    With `announce_s` > 0 the drain starts that long after the signal:
    `announce()` turns the worker Not Ready and says whether it was Ready
    (a worker no router sends to drains at once); meanwhile it serves as
    before, so requests routed before the routers saw the pod go still find
    it listening. A second signal starts the drain at once.
    """
    main, side = servers[0], servers[1:]
    for server in servers:
        # uvicorn would let each server take the signal for itself (the last
        # one started wins), stopping the bootstrap server first.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    loop = asyncio.get_running_loop()
    announcing: list[asyncio.TimerHandle] = []

    def drain(sig: signal.Signals) -> None:
        for timer in announcing:
            timer.cancel()
        log.info("%s: draining in-flight requests, then stopping", sig.name)
        main.should_exit = True

    def stop(sig: signal.Signals) -> None:
        if main.should_exit and sig == signal.SIGINT:
            main.force_exit = True  # a second Ctrl-C: stop waiting for the drain
        if announcing or main.should_exit or announce_s <= 0:
            drain(sig)
        elif announce is not None and announce():
            log.info(
                "%s: Not Ready now; draining in %.1fs, once routers saw it", sig.name, announce_s
            )
            announcing.append(loop.call_later(announce_s, drain, sig))
        else:
            drain(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop, sig)
    broken: list[asyncio.Future[Any]] = []

    def side_ended(task: asyncio.Future[Any]) -> None:
        if not main.should_exit:  # e.g. its port was taken: the worker cannot serve
            log.error("a side server of this worker stopped; stopping the worker")
            broken.append(task)
            main.should_exit = True

    side_tasks = [asyncio.ensure_future(s.serve()) for s in side]
    for task in side_tasks:
        task.add_done_callback(side_ended)
    try:
        await main.serve()
    finally:
        for server in side:
            server.should_exit = True
        await asyncio.gather(*side_tasks, return_exceptions=True)
    if broken:
        raise SystemExit(1)


def run_worker(manifest: PDCluster, args: argparse.Namespace) -> int:
    dp_ports = _dp_ports_arg(manifest, args)
    settings = WorkerSettings(
        manifest=manifest,
        role=Role.parse(args.role),
        instance=args.instance,
        host=args.host,
        advertise_host=os.environ.get("POD_IP") or args.host,
        port=args.port,
        dist_port=args.dist_port,
        bootstrap_port=args.bootstrap_port,
        token=read_cluster_token(os.environ),
        shm_dir=os.environ.get("PDCLUSTER_SHM_DIR"),
        tokenizer=getattr(args, "tokenizer", None),
        prefill_peers=_prefill_peers_arg(args),
        event_loop=_event_loop_arg(),
        pod_index=getattr(args, "pod_index", 0),
        dp_ports=dp_ports.http_ports,
        dp_dist_ports=dp_ports.dist_ports[1:],
    )
    try:
        configure_worker_logging(settings)
    except ValueError as err:
        raise SystemExit(f"pdcluster worker: {err}") from None
    if not settings.token and os.environ.get("KUBERNETES_SERVICE_HOST"):
        # An empty token would turn every check off; the operator always sets one.
        raise SystemExit(
            "pdcluster worker: PDCLUSTER_TOKEN is empty; on Kubernetes a worker needs the "
            "cluster token (the operator sets it from the cluster's Secret)"
        )
    try:
        plan = plan_pod(settings.layout, settings.role_spec.topology.dp, settings.pod_index)
    except RendezvousError as err:
        raise SystemExit(f"pdcluster worker: --pod-index {settings.pod_index}: {err}") from None
    if not plan.is_leader:
        from pdcluster.runtime.leader_address import wait_leader_address

        try:
            leader = wait_leader_address(getattr(args, "leader_address", None), os.environ)
        except RendezvousError as err:
            raise SystemExit(f"pdcluster worker: {err}") from None
        settings = replace(settings, leader_host=leader)
    if settings.role is Role.prefill and settings.bootstrap_port is None:
        raise SystemExit("pdcluster worker: --bootstrap-port is required for the prefill role")
    if manifest.spec.transfer.backend is TransferBackend.nixl:
        from pdcluster.runtime.transfer.nixl_support import apply_ucx_env

        apply_ucx_env(manifest.spec.transfer.ucx)  # inherited by every rank process
    owned_shm = None
    spec = manifest.spec
    if (
        settings.role is Role.decode
        and settings.shm_dir is None
        and spec.transfer.backend is TransferBackend.shm
    ):
        from pdcluster.runtime.transfer.shm_dirs import make_pool_dir, sweep_stale_pool_dirs

        # Decode's KV pool lives in shared memory so same-node prefill ranks can write it.
        # Directories left by killed workers of this cluster are removed first.
        sweep_stale_pool_dirs(manifest.metadata.name)
        owned_shm = make_pool_dir(manifest.metadata.name)
        settings = replace(settings, shm_dir=owned_shm)
    try:
        return _run_instance(settings, plan) if plan.is_leader else _run_pod(settings, plan)
    finally:
        if owned_shm is not None:
            shutil.rmtree(owned_shm, ignore_errors=True)


def _event_loop_arg() -> EventLoop:
    try:
        return event_loop.event_loop_from_env(os.environ)
    except ValueError as err:
        raise SystemExit(f"pdcluster worker: {err}") from None


def _dp_ports_arg(manifest: PDCluster, args: argparse.Namespace) -> DpPorts:
    rs = manifest.spec.role_spec(Role.parse(args.role))
    dp = rs.topology.dp if rs is not None else 1
    try:
        http = getattr(args, "dp_ports", None)
        dist = getattr(args, "dp_dist_ports", None)
        return resolve_dp_ports(
            dp,
            args.dist_port,
            None if http is None else parse_port_list(http, "--dp-ports"),
            None if dist is None else parse_port_list(dist, "--dp-dist-ports"),
        )
    except DpPortsError as err:
        raise SystemExit(f"pdcluster worker: {err}") from None


def _prefill_peers_arg(args: argparse.Namespace) -> frozenset[BootstrapAddress] | None:
    from pdcluster.runtime.pd.known_peers import PeerSetError, parse_peers_env

    raw = getattr(args, "prefill_peers", None)
    if raw is None:
        return None
    try:
        return parse_peers_env(raw)
    except PeerSetError as err:
        raise SystemExit(f"pdcluster worker: --prefill-peers: {err}") from None


# The leader pod's address directory (store, listener) of a multi-pod dp > 1
# instance, hosted by this process; dp group 0's rank 0 reuses the store.
_DIRECTORY: list[Any] = []
# How long a pod waits for the addresses it needs (the other pods are starting too).
ADDRESS_TIMEOUT_S = 600.0


def _identity(settings: WorkerSettings) -> RankIdentity:
    return RankIdentity(settings.manifest.metadata.name, settings.role.value, settings.instance)


def _with_group_hosts(settings: WorkerSettings, plan: PodPlan) -> WorkerSettings:
    """Multi-pod dp > 1: exchange addresses through the leader pod's directory
    (pod 0 hosts it and waits for the dp leader pods; a pod k > 0 publishes its
    own and reads those it needs) and record where each dp group is reached."""
    dp = settings.role_spec.topology.dp
    if dp == 1 or not settings.layout.is_multi_pod:
        return settings
    from pdcluster.runtime.engine.parallel import dial_store, host_store
    from pdcluster.runtime.engine.rendezvous import (
        open_directory,
        publish_address,
        wait_addresses,
    )

    who = _identity(settings)
    leader = settings.leader_advertise_host
    known: dict[int, str] = {}
    nonce: str | None = None
    try:
        if plan.is_leader:
            # The same timeout as a store init_distributed makes (group 0 reuses it).
            _DIRECTORY.extend(host_store(store_host(leader, True), settings.dist_port, 120.0))
            store = _DIRECTORY[0]
            nonce = open_directory(store)
        elif plan.publishes or plan.needs:
            store = dial_store(leader, settings.dist_port, ADDRESS_TIMEOUT_S)
        else:
            store = None
        if plan.publishes:
            publish_address(
                store,
                settings.token,
                who,
                plan.pod_index,
                settings.advertise_host,
                ADDRESS_TIMEOUT_S,
            )
        if plan.needs:
            log.info("waiting for the addresses of pods %s", list(plan.needs))
            known = wait_addresses(
                store, settings.token, who, plan.needs, ADDRESS_TIMEOUT_S, nonce=nonce
            )
    except (RuntimeError, OSError) as err:  # torch's store errors are RuntimeErrors
        raise RendezvousError(
            f"the address directory at {leader}:{settings.dist_port} failed: {err}"
        ) from None
    hosts = group_hosts(settings.layout, dp, plan.pod_index, settings.advertise_host, leader, known)
    log.info("dp group leaders reached at %s", list(hosts))
    return replace(settings, group_hosts=hosts)


def _run_instance(settings: WorkerSettings, plan: PodPlan) -> int:
    try:
        settings = _with_group_hosts(settings, plan)
    except RendezvousError as err:
        raise SystemExit(f"pdcluster worker: {err}") from None
    children = _start_children(settings, settings.layout.rank_range(0))
    if children:
        _watch_children(children)
    serve_leader(settings, 0, port=settings.port, host=settings.host)
    # The drain is over and group 0's followers were shut down; dp leaders of
    # other groups drain on SIGTERM and shut their own followers down.
    _stop_children(children, DRAIN_MARGIN_SECONDS)
    return 0


def _is_dp_leader(settings: WorkerSettings, child: multiprocessing.process.BaseProcess) -> bool:
    topo = settings.role_spec.topology
    rank = int(str(child.name).removeprefix("rank-"))
    return rank % (topo.cp * topo.tp * topo.pp) == 0


def _stop_children(children: list[multiprocessing.process.BaseProcess], within_s: float) -> None:
    """SIGTERM every rank (dp leaders drain, followers ignore it and end with their
    group), then kill what is still running after `within_s` seconds."""
    for child in children:
        if child.is_alive():
            child.terminate()
    deadline = time.monotonic() + within_s
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
        if child.is_alive():
            log.error("%s did not stop within %.0fs; killing it", child.name, within_s)
            child.kill()
            child.join(5)


def _run_pod(settings: WorkerSettings, plan: PodPlan) -> int:
    """A pod k > 0: run its ranks until one ends (1) or the pod is stopped (0).

    A stop (SIGTERM/SIGINT) kills no rank: the instance drains through its
    leader (issue: a follower killed first breaks the collectives of the
    requests the leader is finishing). The pod forwards the signal to the dp
    leaders it hosts (they drain their own group), waits for its ranks to end
    — followers end when their group leader shuts the group down — and kills
    what still runs after the role's drain budget plus a margin (its own
    grace is one margin longer, builders/disruption.py).

    This process runs no rank itself, so a signal is handled at once even
    while the ranks block in a collective.
    """
    from multiprocessing.connection import wait

    log.info(
        "pod %d of %s-%d: ranks %s, leader at %s",
        plan.pod_index,
        settings.role.value,
        settings.instance,
        list(plan.ranks),
        settings.leader_host,
    )
    try:
        settings = _with_group_hosts(settings, plan)
    except RendezvousError as err:
        log.error("%s", err)
        return 1
    children = _start_children(settings, plan.ranks)
    stopping = threading.Event()

    def stop(signum: int, _frame: object) -> None:
        if stopping.is_set():
            return
        stopping.set()
        log.info("%s: ranks keep running until their leaders drained", signal.Signals(signum).name)
        for child in children:
            if _is_dp_leader(settings, child) and child.is_alive():
                child.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    wait([c.sentinel for c in children])
    if stopping.is_set():
        drain_s = settings.role_spec.drain.stop_seconds(
            settings.manifest.spec.router.request_timeout_seconds
        )
        # Every rank: its group leader drains, then shuts it down.
        deadline = time.monotonic() + drain_s + DRAIN_MARGIN_SECONDS
        for child in children:
            child.join(max(0.0, deadline - time.monotonic()))
        code = 0
    else:
        dead = next(c for c in children if c.exitcode is not None)
        if dead.exitcode == 0:
            # Its leader shut the group down (the instance drained and stopped).
            log.info("%s ended with its group; stopping the pod", dead.name)
            code = 0
        else:
            log.error("%s exited (code %s); stopping the pod", dead.name, dead.exitcode)
            code = 1
    _stop_children(children, DRAIN_MARGIN_SECONDS)
    return code


def _watch_children(children: list[multiprocessing.process.BaseProcess]) -> None:
    """Exit the whole instance when any rank dies (gang semantics)."""

    def watch() -> None:
        from multiprocessing.connection import wait

        wait([c.sentinel for c in children])
        dead = [c for c in children if c.exitcode is not None]
        log.error(
            "rank process %s exited (code %s); stopping the instance",
            dead[0].name if dead else "?",
            dead[0].exitcode if dead else "?",
        )
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="rank-watch", daemon=True).start()
