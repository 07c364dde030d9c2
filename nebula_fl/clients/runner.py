"""The cluster's ClientApp runner: a SuperNode of a nebula-fl cluster runs nebula-fl's ClientApp, never a bundle's.

A stock SuperNode hands every message to a fresh ``flwr-clientapp`` process that unpacks the run's app bundle
(FAB) and executes whatever ClientApp it names: anyone who can submit a run to the SuperLink (Flower 1.42's
Control API has no authentication), or a malicious SuperLink itself, runs code on every cluster host. Here the
SuperNode is started with ``--isolation process`` and this runner takes the SuperExec's place on its Runtime
API: it acquires each ClientApp task (signed with the SuperNode's SuperExec secret, so no other local process
can take one), reads the bundle as data only (bundle_check.py: configuration, nebula-fl's own components, this
nebula-fl version) and runs ``nebula_fl.clients.app:app`` from the installed package. A refused bundle gets an
error reply and one line in this runner's log; nothing of it is unpacked, installed, imported or executed.

It is persistent, so a task costs no interpreter start and no imports (a ``flwr-clientapp`` spent a median 1.77 s
of each hop on those, the runner 0.05 s: docs, Where a round's time goes); tasks run on threads, so a
secure-aggregation query is answered while a round trains.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from nebula_fl import __version__
from nebula_fl.clients.bundle_check import BundleRefused, check_bundle
from nebula_fl.errors import ConfigError

POLL_S = 0.1  # how often the runner asks its SuperNode for a task (a local call), unless POLL_ENV says otherwise
POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"  # Flower's SuperExec's knob: the runner takes its place, and its knob
MAX_TASKS = 16  # ClientApp tasks in flight at once (each mostly waits on the trainer)
RETRY_S = 1.0  # the SuperNode is (re)starting: ask again after this long


@dataclass(kw_only=True)
class RunnerOptions:
    runtime_api_address: str  # the SuperNode's Runtime API, host:port (flower-supernode --port)
    auth_secret: bytes | None = None  # the SuperNode's --superexec-auth-secret-file contents
    root_certificates: bytes | None = None  # the Runtime API's CA, when it serves TLS (else plain HTTP)
    poll_s: float = field(default_factory=lambda: _poll_from_env(os.environ.get(POLL_ENV)))
    max_tasks: int = MAX_TASKS

    def __post_init__(self) -> None:
        host, sep, port = self.runtime_api_address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--runtime-api-address {self.runtime_api_address!r} is not HOST:PORT; give the "
                              "SuperNode's Runtime API address, e.g. 127.0.0.1:9094 (flower-supernode --port)")
        if self.auth_secret is not None and not self.auth_secret:
            raise ConfigError("the SuperExec secret is empty; write random bytes to the file given to both "
                              "flower-supernode and this runner with --superexec-auth-secret-file")
        if not 0.01 <= self.poll_s <= 60:  # (NaN fails too)
            raise ConfigError(f"the task poll interval {self.poll_s} s ({POLL_ENV}) must be within 0.01-60 s")
        if not 1 <= self.max_tasks <= 256:
            raise ConfigError(f"max_tasks {self.max_tasks} must be within 1-256")


def _poll_from_env(value: str | None) -> float:
    if value is None:
        return POLL_S
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{POLL_ENV}={value!r} is not a number of seconds; set it within 0.01-60 or unset it") from None


def _log(text: str) -> None:
    print(f"clientapp runner: {text}", flush=True)


def _client(opts: RunnerOptions, interceptors: list):
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient

    return RuntimeHttpClient.from_server_address(
        server_address=opts.runtime_api_address, insecure=opts.root_certificates is None,
        root_certificates=opts.root_certificates, interceptors=interceptors,
        retry_invoker=make_simple_http_retry_invoker(),
    )


def run_task(opts: RunnerOptions, token: str, app, *, acquired_at: float | None = None) -> str:
    """One ClientApp task: pull its message, check the run's bundle, answer with nebula-fl's ClientApp (or an error
    reply), report the task's end. Returns how it ended: 'completed', 'refused' or 'failed'."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common.constant import ErrorCode, SubStatus
    from flwr.supercore.heartbeat import HeartbeatSender, make_task_heartbeat_fn_http
    from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
    from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

    from nebula_fl.clients.app import current_task

    client = _client(opts, [RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                            RuntimeTokenHttpInterceptor(token)])
    heartbeat = HeartbeatSender(make_task_heartbeat_fn_http(client))
    message = context = reply = None
    outcome, sub_status, details = "failed", SubStatus.FAILED, "the ClientApp task failed"
    try:
        heartbeat.start()
        message, context, run, fab = pull_task_input(client)
        try:
            check_bundle(fab.content, own_version=__version__)
        except BundleRefused as err:
            outcome, details = "refused", f"refused by the nebula-fl cluster: {err}"
            _log(f"refused run {run.run_id} ({run.fab_id or 'no id'} {run.fab_version or ''}, bundle "
                 f"{fab.hash_str[:12]}): {err}")
            reply = Message(Error(code=ErrorCode.LOAD_CLIENT_APP_EXCEPTION, reason=details), reply_to=message)
        else:
            config = message.content.config_records.get("config") if message.has_content() else None
            number = config.get("server-round") if config is not None else None
            _log(f"run {run.run_id}: {message.metadata.message_type} message"
                 + (f", round {number}" if number is not None else ""))
            current_task.started_at = acquired_at
            reply = app(message=message, context=context)
            outcome, sub_status, details = "completed", SubStatus.COMPLETED, ""
    except Exception as err:  # the ClientApp raised (e.g. the trainer refused): an error reply, as Flower's runner does
        details = f"{type(err).__name__}: {err}"
        _log(f"task failed: {details}")
        if message is not None:
            reply = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=details), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
            push_task_output(client=client, context=context, sub_status=sub_status, details=details)
        except Exception as err:  # the SuperNode went away: its task expires there
            _log(f"could not hand the reply back to the SuperNode: {type(err).__name__}: {err}")
            outcome = "failed"
        if heartbeat.is_running:
            heartbeat.stop()
        client.close()
    return outcome


def serve(opts: RunnerOptions, *, stop: threading.Event | None = None) -> None:
    """Acquire ClientApp tasks from the SuperNode and run each on a thread, until `stop` is set (or forever)."""
    import httpx
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor

    from nebula_fl.clients.app import app  # the only ClientApp this runner ever runs, imported once

    stop = stop or threading.Event()
    interceptors: list = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
    if opts.auth_secret:
        interceptors.append(SuperExecAuthHttpInterceptor(
            master_secret=opts.auth_secret, protected_methods=frozenset({"/flwr.proto.Runtime/AcquireTask"})))
    client = _client(opts, interceptors)
    pool = ThreadPoolExecutor(max_workers=opts.max_tasks, thread_name_prefix="task")
    _log(f"serving nebula-fl {__version__}'s ClientApp to the SuperNode at {opts.runtime_api_address}; app bundles "
         "are read as configuration only")
    unreachable = False
    try:
        while not stop.is_set():
            try:
                res = client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
            except (httpx.HTTPError, OSError) as err:
                if not unreachable:
                    _log(f"the SuperNode at {opts.runtime_api_address} does not answer ({type(err).__name__}); "
                         "retrying")
                unreachable = True
                stop.wait(RETRY_S)
                continue
            if unreachable:
                _log("the SuperNode answers again")
                unreachable = False
            if res.HasField("task") and res.token:
                pool.submit(run_task, opts, res.token, app, acquired_at=time.time())
                continue  # another task may be waiting
            stop.wait(opts.poll_s)
    finally:
        pool.shutdown(wait=True, cancel_futures=False)
        client.close()


def main(*, runtime_api_address: str, auth_secret_file: str | None, root_certificates: str | None) -> int:
    def read(path: str | None, what: str) -> bytes | None:
        if path is None:
            return None
        try:
            return Path(path).expanduser().read_bytes()
        except OSError as err:
            raise ConfigError(f"cannot read the {what} '{path}' ({err.strerror}); check the path and that this "
                              "user may read it") from None

    opts = RunnerOptions(runtime_api_address=runtime_api_address,
                         auth_secret=read(auth_secret_file, "SuperExec secret"),
                         root_certificates=read(root_certificates, "Runtime API CA certificate"))
    try:
        serve(opts)
    except KeyboardInterrupt:
        pass
    return 0

