"""Ray side of the `pdserve` CLI: `serve`, `up`, `down`, `status`, `scale`, `role` (flags and config
loading: deploy/commands.py, which imports this module only for these commands).

`serve` (foreground): with the config validated (a bad one exits 2 before Ray starts); start an
embedded single-node Ray, or join `--address`; create the controller (deploy/controller.py), which
places the router and both pools; print the ready line; wait for SIGINT/SIGTERM (or for the
controller to go away: `pdserve down`); then drain (router stops admitting, requests in flight
finish, workers stop), remove every actor and placement group, and stop the Ray it started.

`up` does the same on an existing cluster with a detached controller and returns at once; `down`
drains and removes it. `status` and `scale` talk to the running controller, found by name
(`controller` in namespace `pdserve`) on the cluster at `--address` (default: `auto`).

The embedded Ray declares as many logical CPUs as the config can use at its largest (the router
plus every pool at max_replicas), at least the machine's core count: logical CPUs are Ray's
bookkeeping, not a hard limit, and torch threads follow each worker's own `num_cpus`.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import get_placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from common.config import PdserveConfig
from common.serving import announce_ready
from deploy import role
from deploy.commands import SHUTDOWN_GRACE_S, custom_resources, format_status, logical_cpus, parse_scale_targets
from deploy.controller import CONTROLLER_NAME, Controller, DeployOptions
from deploy.placement import NAMESPACE

log = logging.getLogger(__name__)


def run(args: argparse.Namespace, config: PdserveConfig | None) -> int:
    """`config`: the validated config of `serve` and `up` (None for the other commands)."""
    if args.command == "serve":
        return serve(args, config)
    sys.stdout = DriverStdout(answers=sys.stdout, events=sys.stderr)
    if args.command == "up":
        return up(args, config)
    return {"down": down, "status": status, "scale": scale}[args.command](args)


# ---- serve ------------------------------------------------------------------------------------
class _Signals:
    """SIGINT/SIGTERM: the first asks for a graceful drain, a second one for an immediate stop."""

    def __init__(self) -> None:
        self.count = 0
        self.event = threading.Event()

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.count += 1
        self.event.set()


def serve(args: argparse.Namespace, config: PdserveConfig) -> int:
    signals = _Signals()
    signals.install()
    embedded = args.address is None
    try:
        if embedded:
            num_cpus = args.num_cpus or logical_cpus(config)
            ray.init(address="local", num_cpus=num_cpus, resources=custom_resources(config), include_dashboard=False,
                     namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=True)
        else:
            _token_auth_if_available()
            ray.init(address=args.address, namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=True)
    except Exception as exc:  # noqa: BLE001 - report any failure to start or join Ray as one line
        print(f"pdserve: cannot {'start' if embedded else 'join'} Ray: {exc}", file=sys.stderr)
        return 1
    signals.install()  # after ray.init, which may install its own handlers
    try:
        return _serve_foreground(config, args, embedded, signals)
    finally:
        ray.shutdown()


def _serve_foreground(config: PdserveConfig, args: argparse.Namespace, embedded: bool, signals: _Signals) -> int:
    bind = args.bind_host or ("127.0.0.1" if embedded else None)
    controller = _create_controller(config, DeployOptions(bind_host=bind, log_level=args.log_level), detached=False)
    if controller is None:
        return 1
    started = controller.start.remote()
    while not ray.wait([started], timeout=0.2)[0]:
        if signals.event.is_set():
            print("pdserve: interrupted while starting; stopping", file=sys.stderr)
            ray.kill(controller)
            return 0
    try:
        endpoints = ray.get(started)
    except Exception as exc:  # noqa: BLE001
        print(f"pdserve: failed to start: {_cause(exc)}", file=sys.stderr)
        ray.kill(controller)
        return 1
    _print_ready(endpoints)
    while not signals.event.wait(2.0):
        if not _embedded_ray_alive(embedded):
            return _ray_died()
        try:
            ray.get(controller.ping.remote(), timeout=30)
        except RayActorError:
            print("pdserve: the controller is gone (pdserve down?); exiting", file=sys.stderr)
            return 0
        except GetTimeoutError:
            continue
    print("pdserve: draining (router stops admitting, requests in flight finish)", file=sys.stderr, flush=True)
    stopping = controller.shutdown.remote(SHUTDOWN_GRACE_S)
    deadline = time.monotonic() + SHUTDOWN_GRACE_S + 60
    while not ray.wait([stopping], timeout=0.2)[0]:
        if not _embedded_ray_alive(embedded):
            return _ray_died()
        if signals.count > 1 or time.monotonic() > deadline:
            print("pdserve: stopping now, without waiting for requests in flight", file=sys.stderr)
            break
    ray.kill(controller)
    print("pdserve: stopped", file=sys.stderr, flush=True)
    return 0


def _embedded_ray_alive(embedded: bool) -> bool:
    """False once a process of the Ray we started has died (e.g. a SIGTERM sent to our whole
    process group reached Ray's own daemons too)."""
    if not embedded:
        return True
    try:
        from ray._private import worker

        node = worker._global_node
        return node is None or not node.dead_processes()
    except Exception:  # noqa: BLE001 - private API: when in doubt, assume alive
        return True


def _ray_died() -> int:
    print("pdserve: Ray's own processes stopped (a signal to the whole process group?); exiting without a drain",
          file=sys.stderr, flush=True)
    return 1


def _print_ready(endpoints: dict) -> None:
    ray_address = ray.get_runtime_context().gcs_address
    announce_ready(role="pdserve", address=endpoints["grpc"], **endpoints, ray_address=ray_address, namespace=NAMESPACE)
    print(f"pdserve ready: grpc={endpoints['grpc']} http={endpoints['http']} ray={ray_address}", flush=True)


# ---- up / down -----------------------------------------------------------------------------------
def up(args: argparse.Namespace, config: PdserveConfig) -> int:
    if not _connect(args.address):
        return 1
    controller = _create_controller(config, DeployOptions(bind_host=args.bind_host, log_level=args.log_level, detached=True),
                                    detached=True)
    if controller is None:
        return 1
    try:
        endpoints = ray.get(controller.start.remote())
    except Exception as exc:  # noqa: BLE001
        print(f"pdserve: failed to start: {_cause(exc)}", file=sys.stderr)
        ray.get(controller.shutdown.remote(5.0))
        ray.kill(controller)
        return 1
    _print_ready(endpoints)
    return 0


def down(args: argparse.Namespace) -> int:
    if not _connect(args.address):
        return 1
    controller = _get_controller()
    if controller is not None:
        summary = ray.get(controller.shutdown.remote(args.grace), timeout=args.grace + 120)
        ray.kill(controller)
        print(f"pdserve: stopped ({summary['stopped_workers']} workers)")
    else:
        print("pdserve: not running on this cluster")
    _remove_leftovers()
    return 0


def _remove_leftovers() -> None:
    """Detached actors and placement groups of a controller that died without cleaning up."""
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == NAMESPACE and entry["name"].startswith("pdserve:"):
            ray.kill(ray.get_actor(entry["name"], namespace=NAMESPACE), no_restart=True)
    for info in ray.util.placement_group_table().values():
        if info.get("name", "").startswith("pdserve:") and info.get("state") != "REMOVED":
            remove_placement_group(get_placement_group(info["name"]))


# ---- status / scale ------------------------------------------------------------------------------
def status(args: argparse.Namespace) -> int:
    controller = _running_controller(args.address)
    if controller is None:
        return 1
    report = ray.get(controller.status.remote(), timeout=60)
    print(json.dumps(report, indent=2) if args.json else format_status(report))
    return 0


def scale(args: argparse.Namespace) -> int:
    try:
        targets = parse_scale_targets(args.pools)
    except ValueError as exc:
        print(f"pdserve scale: {exc}", file=sys.stderr)
        return 2
    controller = _running_controller(args.address)
    if controller is None:
        return 1
    refs = [controller.scale.remote(role, n) for role, n in targets.items()]
    results, failed = [], False
    for ref in refs:
        try:
            results.append(ray.get(ref))
        except Exception as exc:  # noqa: BLE001
            print(f"pdserve scale: {_cause(exc)}", file=sys.stderr)
            failed = True
    for result in results:
        failed = failed or bool(result["errors"])
        if args.json:
            print(json.dumps(result))
        else:
            removed = ", ".join(f"{r['worker_id']} (drained {r.get('in_flight_at_drain', 0)} in flight)" for r in result["removed"])
            print(f"{result['role']}: {result['replicas']} worker(s)"
                  + (f"; added {', '.join(result['added'])}" if result["added"] else "")
                  + (f"; removed {removed}" if removed else "")
                  + (f"; errors: {'; '.join(result['errors'])}" if result["errors"] else ""))
    return 1 if failed else 0


def switch_role(args: argparse.Namespace) -> int:
    """`pdserve role WORKER ROLE` on a Ray deployment: the controller switches the worker in place."""
    sys.stdout = DriverStdout(answers=sys.stdout, events=sys.stderr)
    controller = _running_controller(args.address)
    if controller is None:
        return 1
    try:
        result = ray.get(controller.switch_role.remote(args.worker, args.role), timeout=args.timeout)
    except Exception as exc:  # noqa: BLE001
        print(f"pdserve role: {_cause(exc)}", file=sys.stderr)
        return 2
    role.report(result, args.json)
    return 0


# ---- helpers ---------------------------------------------------------------------------------
def _token_auth_if_available() -> None:
    """Ray turns token authentication on by itself only for `address=auto`; with an explicit
    address do the same when this user has a token (clusters started here require it)."""
    try:
        from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available
    except ImportError:  # a Ray without token authentication
        return
    quiet = logging.getLogger(maybe_enable_token_auth_if_token_available.__module__)
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # it warns "token authentication is enabled" on every CLI call
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        quiet.setLevel(level)


def _connect(address: str | None) -> bool:
    _token_auth_if_available()
    try:
        ray.init(address=address or "auto", namespace=NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        print(f"pdserve: no Ray cluster at {address or 'auto'} ({exc}); start one with `pdserve serve` "
              "or `ray start --head`", file=sys.stderr)
        return False
    return True


class DriverStdout:
    """sys.stdout of a CLI command once it is a Ray driver. Ray prints the events the GCS sends every
    driver ("node ... died: raylet crashes unexpectedly ...") onto sys.stdout from a thread of its own,
    whenever they arrive; those go to stderr here, so that stdout holds only the command's answer, which
    the main thread writes (`pdserve status --json | jq`)."""

    def __init__(self, answers, events) -> None:
        self.answers, self.events = answers, events

    def write(self, text: str) -> int:
        on_main = threading.current_thread() is threading.main_thread()
        return (self.answers if on_main else self.events).write(text)

    def flush(self) -> None:
        self.answers.flush()
        self.events.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.answers, name)


def controller_at(address: str) -> Any:
    """The deployment's controller actor on the Ray cluster at `address` (a driver connection from this
    process, token authentication as the CLI does it); raises RuntimeError when there is none."""
    controller = _running_controller(address)
    if controller is None:
        raise RuntimeError(f"no pdserve controller on the Ray cluster at {address}")
    return controller


def _running_controller(address: str | None) -> Any:
    """The deployment's controller on the cluster at `address`, or None (said on stderr)."""
    if not _connect(address):
        return None
    controller = _get_controller()
    if controller is None:
        print("pdserve: not running on this cluster (start it with `pdserve serve` or `pdserve up`)", file=sys.stderr)
    return controller


def _get_controller() -> Any:
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    except ValueError:
        return None


def _create_controller(config: PdserveConfig, options, detached: bool) -> Any:
    if _get_controller() is not None:
        print("pdserve: already running on this Ray cluster (see `pdserve status`, stop it with `pdserve down`)",
              file=sys.stderr)
        return None
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)  # where pdserve runs, not on any node
    return ray.remote(Controller).options(
        name=CONTROLLER_NAME, namespace=NAMESPACE, num_cpus=0, lifetime="detached" if detached else None, max_restarts=0,
        scheduling_strategy=here,
    ).remote(config, options)


def _cause(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {cause}"
