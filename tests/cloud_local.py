"""The cloud on one machine, run as a process of its own by tests/test_cloud_local.py.

``python tests/cloud_local.py ROOT`` starts an S3-protocol server (moto) and a Ray cluster of a
head with no CPUs for trials and two worker nodes that declare ``gpu_node`` (the stand-in for a
GPU node type), then runs tiny sweeps as ``python -m raycl.tune`` does, through raycl's own
functions (a driver in this process, connected to the cluster):

- ``reference``: a sweep, checkpoints in the bucket; then the same sweep again, which resumes
  from the bucket (and finds it done).
- ``outage`` (with ``reference``: the same sweep): the bucket's server stopped right after
  epoch 1's checkpoint (connections refused), so epoch 2's checkpoint is written into the
  outage; restarted once that upload has met it. The trial waits in place, so it is still the
  run the others are compared with.
- ``drained``: the trial's worker node is drained with the preemption reason, then removed.
- ``killed``: the trial's worker node is killed abruptly (no drain).
- ``postgres``: four trials at once log to an MLflow server (``python -m raycl.server``) whose
  database is a PostgreSQL this process starts on loopback, in ``ROOT`` (PostgreSQL 15's
  ``initdb``/``pg_ctl`` on the PATH or in /usr/lib/postgresql/15/bin; as root they run as the
  ``postgres`` user, since PostgreSQL refuses root).

``python tests/cloud_local.py ROOT autoscale`` instead starts a head of its own with Ray's fake
multi-node autoscaler (``ray start --head --autoscaling-config`` with ``RAY_FAKE_CLUSTER=1``;
not ``AutoscalingCluster``, whose ``start`` runs ``ray stop --force`` and reads an example config
the wheel lacks): zero worker nodes, two concurrent trials that need ``gpu_node``, the nodes
released after the idle timeout.

Each outcome (what the driver returned, how long it took, where the trial ran) goes to
``ROOT/outcome.json``; the test reads it and MLflow's database. Nothing here is shared with the
test session's Ray: this process is the only driver of its cluster, its temp directory
(``TMPDIR`` and ``RAY_TMPDIR``, set by the test) is ``ROOT``, so Ray writes nothing under the
machine's ``/tmp/ray``, and everything it started ends with it (``Cluster.shutdown``; the moto
thread; the servers it spawned through tests/local_servers.py, which the test stops as well).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from faults import injected_fault, name_fault_file
from local_servers import Spawned, free_port, marked_env, spawn

REPO = Path(__file__).resolve().parents[1]
RESOURCE = "gpu_node"  # what the worker nodes declare and trials ask for
BUCKET = "raycl-test"
STARTED = time.monotonic()
PAUSE_S = 90.0  # the paused worker's wait: longer than taking its node away takes
# A preemption notice's deadline; Ray Train's PreemptionWatcher polls the drain state every 5 s
# by default, every PREEMPTION_POLL[1] s here, so it sees the notice before the node goes.
DRAIN_NOTICE_S = 2.0
PREEMPTION_POLL = ("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
# Tune snapshots a sweep's state (its experiment state, the searcher's, each trial's result
# files) and uploads all of it to the bucket, by default ("auto") ~25 times for one trial's
# sweep here: most of the bucket's requests. Here at most once a minute, besides the snapshots
# Tune forces, the one at the end of a sweep (what the re-run resumes from) included.
TUNE_SNAPSHOTS = ("TUNE_GLOBAL_CHECKPOINT_S", "60")
SHRUNK = {"data.samples_per_combination": 1, "data.resolution": 16, "train.batch_size": 64,
          "model.width": 8, "model.projector_hidden_dim": 32, "model.projector_dim": 16,
          "eval.linear_max_iter": 50, "train.epochs": 2, "eval.every_n_epochs": 2,
          "scaling.num_workers": 1, "scaling.cpus_per_worker": 1,
          "tune.num_samples": 1, "eval.baseline": False,
          "mlflow.log_encoder": False}
# The reference sweep (and its rerun, which must be the same sweep) skips the end-of-trial
# spectrum and plots, which nothing reads there (the drained and killed trials' are checked):
# they come after every metric, so its objective is still the one the others must end with.
REFERENCE = ("eval.diagnostics=false",)


def import_sweep_modules() -> None:
    """What a sweep's driver imports (Tune, raycl's checks and tuner, the trial function with
    torch): seconds of CPU, spent while the cluster starts rather than before the first sweep."""
    import raycl.launch.checks
    import raycl.launch.load
    import raycl.launch.placement
    import raycl.sweep.display
    import raycl.sweep.tuner
    import raycl.trial.trainable  # noqa: F401


def mark(phase: str) -> None:
    """A line in the output with the seconds since this process started: where the time goes."""
    print(f"[cloud_local {time.monotonic() - STARTED:6.1f} s] {phase}", flush=True)


class S3Server:
    """moto's S3 service on loopback ``port``, served from a thread of this process (moto keeps
    its buckets in the process: a server started again on the port serves them as they were).
    ``ThreadedMotoServer`` serves every moto service and looks up the service of each request
    (~1 ms of CPU each); this hands every request to the S3 app, which that lookup chose for
    every request here."""

    def __init__(self, port: int) -> None:
        from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        self._server = make_server("127.0.0.1", port, create_backend_app("s3"), threaded=True,
                                   request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops serving and closes the port (connections are refused from then on)."""
        self._server.shutdown()  # serve_forever closes the socket as it returns
        self._thread.join()


def start_bucket() -> tuple[S3Server, str, str]:
    """moto's S3 server on loopback with one bucket: the server, its endpoint, and the storage
    URI pointing at the bucket."""
    import boto3

    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    port = free_port()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
    server = S3Server(port)
    endpoint = f"127.0.0.1:{port}"
    boto3.client("s3", endpoint_url=f"http://{endpoint}").create_bucket(Bucket=BUCKET)
    # pyarrow's S3 URI options (pyarrow.fs.FileSystem.from_uri): endpoint, plain HTTP, region.
    return server, endpoint, (f"s3://{BUCKET}/raycl?endpoint_override={endpoint}&scheme=http"
                              f"&region=us-east-1")


def node_ports() -> dict[str, int]:
    """Ports of one node's own: the test session's Ray holds Ray's fixed defaults."""
    return {name: free_port() for name in (
        "dashboard_agent_listen_port", "metrics_export_port", "runtime_env_agent_port",
        "node_manager_port", "object_manager_port")}


def start_cluster(root: Path) -> Any:
    """A head that runs no trials (CPU 0, as the shipped cluster configs) and two worker nodes
    with 2 CPUs and one ``gpu_node`` each. Node deaths are noticed within ~1.5 s."""
    from ray.cluster_utils import Cluster
    from ray.util import get_node_ip_address

    # Ray Train's placement-group cleaner asks the State API (the dashboard) whether its
    # controller lives: without a dashboard its call hangs, and each trial's end waited 12 s on it
    # ("Monitor thread did not exit within 12.00 seconds"). Every process of the cluster inherits
    # RAY_ADDRESS, so it asks this cluster's, not the newest Ray's on the machine (another test's).
    port = free_port()
    os.environ["RAY_ADDRESS"] = f"{get_node_ip_address()}:{port}"
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "temp_dir": str(root / "ray"), "include_dashboard": True,
        "dashboard_port": free_port(), "gcs_server_port": port,
        # A killed node refuses the GCS's check at once; a busy one still answers within the
        # check's own timeout (10 s), so a short period only makes a death known sooner.
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                           "health_check_initial_delay_ms": 1000},
        **node_ports()})
    if cluster.address != os.environ["RAY_ADDRESS"]:
        raise RuntimeError(f"the head is at {cluster.address}, not {os.environ['RAY_ADDRESS']}")
    for _ in range(2):  # started side by side, then waited for together
        add_worker_node(cluster, wait=False)
    cluster.wait_for_nodes()
    return cluster


def temp_places(cluster: Any, fresh: bool) -> dict[str, Any]:
    """Where this process's Ray wrote: its temp and session directories, the address file
    ``Cluster`` writes for a bare ``ray.init()`` (under $RAY_TMPDIR), every node's sockets."""
    from ray._private.utils import get_ray_address_file

    address_file = Path(get_ray_address_file(None))
    nodes = [cluster.head_node, *cluster.worker_nodes]
    return {"fresh": fresh, "tmpdir": tempfile.gettempdir(),
            "session_dir": cluster.head_node.get_session_dir_path(),
            "address": cluster.address, "address_file": str(address_file),
            "address_written": address_file.read_text() if address_file.is_file() else None,
            "sockets": [socket for node in nodes for socket in
                        (node.plasma_store_socket_name, node.raylet_socket_name)]}


def add_worker_node(cluster: Any, wait: bool = True) -> Any:
    return cluster.add_node(wait=wait, num_cpus=2, resources={RESOURCE: 1}, **node_ports())


def sweep_config(name: str, storage: str, tracking_uri: str, *extra: str) -> Any:
    from raycl.launch.load import load_search

    overrides = [f"{key}={value}" for key, value in SHRUNK.items()]
    overrides += [f"name={name}", f"tune.storage_path={storage}",
                  f"mlflow.tracking_uri={tracking_uri}",
                  f"scaling.resources_per_worker={{{RESOURCE}: 1}}", *extra]
    return load_search(REPO / "searches" / "quickstart.yaml", overrides)


def run_sweep(config: Any, fault: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``python -m raycl.tune`` does once Ray is up (raycl.sweep.run._run); ``fault``: the
    keyword arguments of :func:`faults.injected_fault`, installed while the sweep runs."""
    from raycl.launch.checks import run_checks
    from raycl.launch.placement import CLUSTER_CHECKS
    from raycl.sweep.display import quiet_ray
    from raycl.sweep.tuner import build_tuner

    started = time.monotonic()
    with quiet_ray(), injected_fault(**fault) if fault else nullcontext():
        mark(f"{config.name}: checks")
        run_checks(config, config.name, CLUSTER_CHECKS)
        mark(f"{config.name}: fit")
        results = build_tuner(config, None).fit()
        mark(f"{config.name}: done")
    return {"seconds": round(time.monotonic() - started, 1),
            "errors": [str(result.error)[:500] for result in results if result.error],
            "metrics": [{key: value for key, value in (result.metrics or {}).items()
                         if isinstance(value, (int, float))} for result in results]}


def node_with_trial(cluster: Any) -> Any:
    """The worker node whose ``gpu_node`` is taken: where the trial's Ray Train worker runs."""
    from ray._private.state import available_resources_per_node

    for node in cluster.worker_nodes:
        # A resource all taken is left out of the node's available ones.
        available = available_resources_per_node().get(node.node_id, {})
        if available.get(RESOURCE, 0.0) < 1.0:
            return node
    raise RuntimeError("no worker node holds the trial's worker")


def epoch_logged(tracking_uri: str, name: str) -> bool:
    """Whether the sweep's trial run has its first epoch in MLflow: the report went through Ray
    Train's controller (its checkpoint is registered) and Tune to the driver."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return False
    runs = client.search_runs([experiment.experiment_id], "tags.`raycl.role` = 'trial'")
    return any(client.get_metric_history(run.info.run_id, "train/loss") for run in runs)


def take_node_away(cluster: Any, marker: Path, preempt: bool, log: dict[str, Any],
                   tracking_uri: str, name: str) -> None:
    """Once the paused worker's epoch is reported (``marker``) and has reached MLflow: drain its
    node as a cloud preemption notice does, then remove it; or kill it abruptly."""
    import ray
    from ray.core.generated import autoscaler_pb2

    deadline = time.monotonic() + 300
    while not (marker.exists() and epoch_logged(tracking_uri, name)):
        if time.monotonic() > deadline:
            raise TimeoutError("the trial never reached its pause")
        time.sleep(0.5)
    mark(f"{name}: paused, node goes")
    node = node_with_trial(cluster)
    log["node"] = node.node_id
    if preempt:
        # What the autoscaler and `ray drain-node` send the GCS (Ray's test_draining.py).
        gcs = ray._raylet.GcsClient(address=cluster.address)
        accepted, log["drain_refused"] = gcs.drain_node(
            node.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "spot instance reclaimed (test)", int((time.time() + DRAIN_NOTICE_S) * 1000))
        log["drain_accepted"] = bool(accepted)
        time.sleep(DRAIN_NOTICE_S)  # the notice's deadline: the instance goes after it
    log["removed_at"] = time.monotonic()
    cluster.remove_node(node, allow_graceful=preempt)
    mark(f"{name}: node removed")


def preempted_sweep(cluster: Any, name: str, storage: str, tracking_uri: str, root: Path,
                    preempt: bool) -> dict[str, Any]:
    """A sweep whose trial pauses after epoch 1 while its node is taken away."""
    marker = root / f"{name}.paused"
    log: dict[str, Any] = {}
    taker = threading.Thread(target=take_node_away, daemon=True,
                             args=(cluster, marker, preempt, log, tracking_uri, name))
    taker.start()
    fault = {"after_epoch": 1, "marker": str(marker), "settle_seconds": 2,
             "pause_seconds": PAUSE_S}
    outcome = run_sweep(sweep_config(name, storage, tracking_uri), fault)
    taker.join(timeout=5)
    outcome["node_taken"] = log.get("node")
    outcome["drain_accepted"] = log.get("drain_accepted")
    if "removed_at" in log:
        outcome["ended_after_removal_s"] = round(time.monotonic() - log["removed_at"], 1)
    outcome["diagnostics"] = trial_artifacts(tracking_uri, name, "diagnostics")
    return outcome


# The bucket comes back this long after epoch 2's upload first met it refusing (the worker's
# "is unreachable" line in this process's output): raycl's upload retry (tries 1 s, 3 s, 7 s
# after the first) then finds it back after 3 s or more, longer than Ray's own upload retry
# (3 tries, 1 s and 2 s apart) would have waited. Back no sooner: every second is waited.
BACK_AFTER_UPLOAD_S = 2.0
# Away at most this long, should the upload never meet it (the test then fails: no "is back
# after" line); this long where no output file shows the upload's line (a run by hand).
OUTAGE_LIMIT_S = 60.0
OUTAGE_BY_HAND_S = 14.0
UPLOAD_MET_OUTAGE = re.compile(r"checkpoint upload: the storage \S+ is unreachable")


def refuses(port: int) -> bool:
    """Whether loopback ``port`` refuses connections (a stopped server, not a slow one)."""
    import socket

    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True


def upload_met_outage(output: Path, start: int, limit_s: float) -> bool:
    """Whether the worker's "is unreachable" line shows in ``output`` (this process's stdout,
    from byte ``start`` on) within ``limit_s``; Ray prints the workers' lines there."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        sys.stdout.flush()  # the workers' lines Ray printed to this process's buffer
        with open(output, "rb") as text:
            text.seek(start)
            if UPLOAD_MET_OUTAGE.search(text.read().decode(errors="replace")):
                return True
        time.sleep(0.2)
    return False


def interrupt_bucket(port: int, marker: Path, log: dict[str, Any], tracking_uri: str,
                     name: str, output: Path) -> None:
    """Once the paused worker's epoch 1 is reported (``marker``) and in MLflow: stop the
    bucket's server until ``BACK_AFTER_UPLOAD_S`` after epoch 2's upload met it (``output``:
    this process's stdout), then serve it again on the same port (moto keeps its buckets in
    this process, so the bucket comes back with everything in it)."""
    deadline = time.monotonic() + 300
    while not (marker.exists() and epoch_logged(tracking_uri, name)):
        if time.monotonic() > deadline:
            raise TimeoutError("the trial never reached its pause")
        time.sleep(0.2)
    mark(f"{name}: bucket stops")
    log["server"].stop()
    log["resume"].touch()  # the paused worker goes on: epoch 2's upload meets the outage
    log["stopped_at"] = time.time()
    log["refused"] = refuses(port)
    if not output.is_file():
        time.sleep(OUTAGE_BY_HAND_S)
    elif upload_met_outage(output, output.stat().st_size, OUTAGE_LIMIT_S):
        mark(f"{name}: the upload met the outage")
        time.sleep(BACK_AFTER_UPLOAD_S)
    restarted = S3Server(port)
    log["server"], log["restarted_at"] = restarted, time.time()
    mark(f"{name}: bucket back")


def bucket_outage(server: Any, endpoint: str, storage: str, tracking_uri: str,
                  root: Path, name: str) -> tuple[dict[str, Any], Any]:
    """A sweep whose bucket goes away right after epoch 1's checkpoint until epoch 2's upload
    has met it: the worker pauses briefly after epoch 1, so epoch 2's checkpoint is written
    into the outage.
    Returns the outcome and the bucket's server (a new one, once restarted)."""
    marker = root / f"{name}.paused"
    log: dict[str, Any] = {"server": server, "resume": root / f"{name}.resume"}
    interrupter = threading.Thread(target=interrupt_bucket, daemon=True, args=(
        int(endpoint.rsplit(":", 1)[1]), marker, log, tracking_uri, name, root / "output.log"))
    interrupter.start()
    # The pause outlasts the epoch's way to MLflow (the moment the bucket goes: ~0.5 s alone,
    # a few s on busy cores), so the outage starts before epoch 2's checkpoint, and after Ray
    # Train's controller recorded epoch 1's; it ends as soon as the bucket has gone.
    fault = {"after_epoch": 1, "marker": str(marker), "settle_seconds": 1, "pause_seconds": 5,
             "resume": str(log["resume"])}
    outcome = run_sweep(sweep_config(name, storage, tracking_uri, *REFERENCE), fault)
    interrupter.join(timeout=10)
    outcome.update({key: log.get(key) for key in ("stopped_at", "restarted_at", "refused")})
    if "restarted_at" in log:
        outcome["outage_s"] = round(log["restarted_at"] - log["stopped_at"], 1)
    outcome["runs"] = logged_runs(tracking_uri, name)
    outcome["logged_at"] = epochs_logged_at(tracking_uri, name)
    return outcome, log["server"]


def epochs_logged_at(tracking_uri: str, name: str) -> dict[int, float]:
    """When (the driver's clock, seconds) each epoch's ``train/loss`` reached MLflow."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(name)
    runs = client.search_runs([experiment.experiment_id], "tags.`raycl.role` = 'trial'")
    return {metric.step: metric.timestamp / 1000 for run in runs
            for metric in client.get_metric_history(run.info.run_id, "train/loss")}


def trial_artifacts(tracking_uri: str, name: str, folder: str) -> list[str]:
    """The artifacts under ``folder`` of sweep ``name``'s trial runs, listed here: the test reads
    this process's outcome, not its (temporary) artifact store."""
    from mlflow import MlflowClient

    from raycl.tracking import ROLE_TAG

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        return []
    return [item.path for run in client.search_runs([experiment.experiment_id])
            if run.data.tags.get(ROLE_TAG) == "trial"
            for item in client.list_artifacts(run.info.run_id, folder)]


PG_BIN = Path("/usr/lib/postgresql/15/bin")


def postgres_command(name: str) -> list[str] | None:
    """How to run PostgreSQL's ``name`` here (None: not installed, or root without a
    ``postgres`` user to run it as)."""
    found = shutil.which(name) or (str(PG_BIN / name) if (PG_BIN / name).exists() else None)
    if found is None:
        return None
    if os.geteuid() != 0:
        return [found]
    runuser = shutil.which("runuser")
    try:
        import pwd

        pwd.getpwnam("postgres")
    except KeyError:
        return None
    return [runuser, "-u", "postgres", "--", found] if runuser else None


Postgres = tuple[list[str], Path, str, Spawned]


def start_postgres(root: Path) -> Postgres:
    """A PostgreSQL on loopback with its data and socket in a directory of its own under
    ``root`` (one the ``postgres`` user can enter): ``pg_ctl`` (to stop it), the data directory,
    the database URI, and the handle that stops whatever of it is left (``pg_ctl start`` leaves
    the postmaster in a session of its own). Raises RuntimeError when it cannot run."""
    initdb, pg_ctl = postgres_command("initdb"), postgres_command("pg_ctl")
    if initdb is None or pg_ctl is None:
        raise RuntimeError("PostgreSQL's initdb/pg_ctl are not available")
    directory = Path(tempfile.mkdtemp(prefix="pg-", dir=root))
    if os.geteuid() == 0:
        root.chmod(0o711)  # the postgres user passes through to its own directory
        shutil.chown(directory, "postgres", "postgres")
    data, port = directory / "data", free_port()
    options = f"-h 127.0.0.1 -p {port} -k {directory} -F"  # -F: no fsync (a throwaway)
    steps = {"initdb": [*initdb, "-D", str(data), "-A", "trust", "-U", "raycl", "--no-sync"],
             "pg_ctl start": [*pg_ctl, "-D", str(data), "-o", options, "-l",
                              str(directory / "log"), "-w", "-t", "60", "start"]}
    env, handle = marked_env()
    for step, command in steps.items():
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False,
                              env=env)
        if done.returncode != 0:
            handle.stop(grace_s=5)  # a server that started but did not answer in time
            raise RuntimeError(f"{step} failed: {(done.stderr or done.stdout).strip()[-300:]}")
    # postgresql+psycopg2: SQLAlchemy 2.1 reads plain postgresql:// as psycopg (3).
    return pg_ctl, data, f"postgresql+psycopg2://raycl@127.0.0.1:{port}/postgres", handle


def stop_postgres(postgres: Postgres) -> None:
    """A fast shutdown (clients disconnected), then whatever is left of it."""
    pg_ctl, data, _, handle = postgres
    subprocess.run([*pg_ctl, "-D", str(data), "-m", "fast", "stop"], check=False,
                   capture_output=True, timeout=60)
    handle.stop(grace_s=5)
    shutil.rmtree(data.parent, ignore_errors=True)


def start_mlflow(root: Path, backend: str) -> tuple[Spawned, str]:
    """``python -m raycl.server`` on loopback with ``backend`` as its database; one server
    worker (each imports MLflow: seconds of CPU), as the sweep's callback sends one request at a
    time."""
    port = free_port()
    server = spawn(
        [sys.executable, "-m", "raycl.server", "--port", str(port), "--workers", "1",
         "--backend-store-uri", backend, "--artifacts-destination", str(root / "artifacts")],
        cwd=root, log=root / "mlflow-server.log")
    return server, f"http://127.0.0.1:{port}"


def wait_for_mlflow(server: Spawned, uri: str, timeout_s: float = 180) -> None:
    import urllib.request

    assert server.process is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the MLflow server exited with {server.process.returncode}")
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{uri} did not answer within {timeout_s:.0f} s")


def four_trials(storage: str, tracking_uri: str, database: str) -> dict[str, Any]:
    """Four trials at once, each training in its own trial process (0.5 CPU each), logging to
    ``tracking_uri``; their runs read back from the server's ``database`` itself."""
    from raycl.launch.load import load_search

    overrides = [f"{key}={value}" for key, value in SHRUNK.items()]
    overrides += ["name=four", f"tune.storage_path={storage}",
                  f"mlflow.tracking_uri={tracking_uri}", "scaling.num_workers=0",
                  "scaling.cpus_per_worker=0.5", "tune.num_samples=4",
                  "tune.max_concurrent_trials=4", "tune.search_space={}",
                  # What is tested is the writes, not the end-of-trial spectrum and plots: four
                  # trial processes importing matplotlib at once on two cores cost seconds.
                  "eval.diagnostics=false"]
    outcome = run_sweep(load_search(REPO / "searches" / "quickstart.yaml", overrides))
    outcome["runs"] = logged_runs(database, "four")
    return outcome


def logged_runs(tracking_uri: str, name: str) -> list[dict[str, Any]]:
    """Each trial run of sweep ``name`` as MLflow has it: status, last metrics, and the steps of
    each metric's history (a lost or doubled write shows there)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(name)
    runs = client.search_runs([experiment.experiment_id], "tags.`raycl.role` = 'trial'")

    def steps(run_id: str, key: str) -> list[int]:
        return sorted(metric.step for metric in client.get_metric_history(run_id, key))

    # A request per run and metric (~100 for four trials): several at once from a server, one
    # at a time from a database file or connection.
    with ThreadPoolExecutor(max_workers=8 if tracking_uri.startswith("http") else 1) as pool:
        histories = [{key: pool.submit(steps, run.info.run_id, key) for key in run.data.metrics}
                     for run in runs]
    return [{"status": run.info.status, "metrics": run.data.metrics,
             "steps": {key: future.result() for key, future in history.items()}}
            for run, history in zip(runs, histories, strict=True)]


IDLE_TIMEOUT_MIN = 0.1  # 6 s


def autoscaling_config(gcs_address: str) -> dict[str, Any]:
    """Ray's fake multi-node provider (the shape of its example.yaml): a head that runs no
    trials and a ``gpu`` node type, 0 to 2 nodes, each 2 CPUs and one ``gpu_node``."""
    return {
        "cluster_name": "raycl-fake", "max_workers": 2, "head_node_type": "ray.head.default",
        "provider": {"type": "fake_multinode", "gcs_address": gcs_address,
                     "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "gpu": {"resources": {"CPU": 2, RESOURCE: 1, "object_store_memory": 150 * 2**20},
                    "node_config": {}, "min_workers": 0, "max_workers": 2}},
        "idle_timeout_minutes": IDLE_TIMEOUT_MIN, "upscaling_speed": 1.0, "auth": {},
        "docker": {}, "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [], "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": []}


def start_autoscaling_head(root: Path) -> tuple[Spawned, str]:
    """``ray start --head --block`` with the fake provider, in its own process group."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    config = root / "autoscaling.json"
    config.write_text(json.dumps(autoscaling_config(address)))
    ports = [f"--{name.replace('_', '-')}={value}" for name, value in
             {**node_ports(), "ray_client_server_port": free_port()}.items()]
    # A dashboard, and RAY_ADDRESS for every process of the cluster (the head, the nodes the
    # autoscaler starts, their workers, this driver): as start_cluster says, Ray Train's
    # placement-group cleaner asks the State API whether its controller lives, and without
    # them it looked for the newest Ray on the machine and hung until its 12 s monitor timeout
    # ("Found multiple active Ray instances", "Failed to query Ray Train Controller").
    os.environ["RAY_ADDRESS"] = address
    # No preemption watcher per trial: nothing drains a node in this scenario.
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
    head = spawn(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
         "--node-ip-address=127.0.0.1", f"--port={port}", f"--autoscaling-config={config}",
         "--num-cpus=0", "--include-dashboard=true", f"--dashboard-port={free_port()}",
         f"--temp-dir={root / 'ray'}",
         "--disable-usage-stats", *ports],
        env=env, cwd=root, log=root / "ray-head.log")
    return head, address


def wait_for_head(head: subprocess.Popen, address: str, root: Path,
                  timeout_s: float = 240.0) -> None:
    """Until the head's GCS lists the head node alive. ``ray.init`` would find the node itself,
    but in one GCS call whose timeout is also its whole wait, which a head started on two busy
    cores (the rest of the suite beside it) has missed; a head that died or never came up
    raises with its logs' ends."""
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and head.poll() is None:
        try:
            nodes = GcsClient(address=address).get_all_node_info(
                timeout=5, state_filter=GcsNodeInfo.GcsNodeState.ALIVE)
            if nodes:
                return
        except Exception:  # the GCS is not serving yet
            pass
        time.sleep(0.25)
    logs = [root / "ray-head.log", *sorted((root / "ray").glob("session_latest/logs/*.out")),
            *sorted((root / "ray").glob("session_latest/logs/*.err"))]
    tails = "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-1500:]}"
                      for log in logs if log.is_file() and log.stat().st_size)
    state = f"exited {head.returncode}" if head.poll() is not None else f"not up in {timeout_s} s"
    raise RuntimeError(f"the autoscaling head at {address} {state}:\n{tails}")


def alive_workers(address: str) -> int:
    """Alive nodes with ``gpu_node``, asked of the GCS (with or without a driver connected)."""
    from ray._raylet import GcsClient
    from ray.core.generated.gcs_pb2 import GcsNodeInfo

    nodes = GcsClient(address=address).get_all_node_info(
        timeout=10, state_filter=GcsNodeInfo.GcsNodeState.ALIVE)
    return sum(1 for node in nodes.values() if node.resources_total.get(RESOURCE))


def first_epoch_at(tracking_uri: str, name: str, started: float, out: dict[str, Any],
                   address: str) -> None:
    """When the sweep's first epoch reached MLflow (seconds after ``started``)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and "first_epoch_s" not in out:
        try:
            if epoch_logged(tracking_uri, name):
                out["first_epoch_s"] = round(time.monotonic() - started, 1)
                mark("first epoch in MLflow")
                return
        except Exception:  # the experiment is being created
            pass
        out["most_workers"] = max(out.get("most_workers", 0), alive_workers(address))
        time.sleep(1.0)  # nodes live for tens of seconds; each look costs this driver CPU


def autoscale(root: Path, storage: str) -> dict[str, Any]:
    """Two concurrent trials on a cluster with no worker node: measured from the sweep's start
    to its first epoch, then until the idle nodes are gone."""
    import ray

    from raycl.sweep.local_ray import init_ray

    spawned, address = start_autoscaling_head(root)
    head = spawned.process
    assert head is not None
    tracking_uri = f"sqlite:///{root / 'mlflow.db'}"
    outcome: dict[str, Any] = {}
    try:
        # The sweep's imports and settings while the head starts. One epoch: what is measured
        # is the nodes' coming and going, not the training.
        import_sweep_modules()
        config = sweep_config("autoscale", storage, tracking_uri, "tune.num_samples=2",
                              "tune.max_concurrent_trials=2", "train.epochs=1",
                              "eval.every_n_epochs=1", "eval.diagnostics=false")
        wait_for_head(head, address, root)
        mark("autoscaling head up")
        try:
            init_ray(quiet=True, address=address, log_to_driver=True)
        except ConnectionError:  # the GCS answered, then missed ray.init's call: once more
            ray.shutdown()
            wait_for_head(head, address, root)
            init_ray(quiet=True, address=address, log_to_driver=True)
        mark("driver connected")
        outcome["workers_at_start"] = alive_workers(address)
        started = time.monotonic()
        watcher = threading.Thread(target=first_epoch_at, daemon=True,
                                   args=(tracking_uri, "autoscale", started, outcome, address))
        watcher.start()
        outcome["sweep"] = run_sweep(config)
        watcher.join(timeout=5)
        outcome["most_workers"] = max(outcome.get("most_workers", 0), alive_workers(address))
        from ray._private.state import actors

        outcome["actors_left"] = [
            (actor.get("ActorClassName"), actor.get("Address", {}).get("NodeID", "")[-5:])
            for actor in actors().values() if actor.get("State") == "ALIVE"]
        # The driver stays connected, as a job's does until its last line: the nodes must go
        # anyway (a detached actor left on one keeps it: raycl.tune pins Ray Train's to the head).
        ended = time.monotonic()
        while alive_workers(address) and time.monotonic() < ended + 60:
            time.sleep(0.25)
        outcome["workers_after_idle"] = alive_workers(address)
        mark("idle workers gone")
        outcome["released_after_s"] = round(time.monotonic() - ended, 1)
    finally:
        ray.shutdown()
        spawned.stop(grace_s=3.0)  # a throwaway head: no graceful drain
    return outcome


def stop_servers(bucket: Any, mlflow: tuple[Spawned, str] | None,
                 postgres: Postgres | None) -> None:
    """The bucket's server, then the MLflow server and its PostgreSQL, where started."""
    bucket.stop()
    if mlflow is not None:
        mlflow[0].stop()
    if postgres is not None:
        stop_postgres(postgres)


def main(root: Path, scenarios: list[str]) -> None:
    name_fault_file(root)  # before any Ray process starts: each of them looks there
    os.environ.setdefault(*TUNE_SNAPSHOTS)
    if scenarios == ["autoscale"]:
        # Token authentication, as on the shipped clusters (`ray start` turns it on), with a
        # token of this process's own for the head and this driver; nothing under ~/.ray is
        # used. Set before Ray is imported: Ray reads its auth mode once.
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    fresh = not (root / "ray").exists()  # Ray's temp dir: made by this process's Ray
    mark("start")
    import ray

    from raycl.sweep.local_ray import init_ray

    mark("imported ray, raycl.tune")
    server, endpoint, storage = start_bucket()
    mark("bucket up")
    outcome: dict[str, Any] = {"storage": storage}
    if scenarios == ["autoscale"]:
        try:
            outcome["autoscale"] = autoscale(root, storage)
        finally:
            (root / "outcome.json").write_text(json.dumps(outcome, indent=1))
            server.stop()
        return
    postgres, mlflow = None, None
    if "postgres" in scenarios:
        # Started first: PostgreSQL and MLflow's migrations come up while the sweeps run.
        try:
            postgres = start_postgres(root)
            mark("postgres up")
            mlflow = start_mlflow(root, postgres[2])
        except (RuntimeError, subprocess.SubprocessError) as exc:
            outcome["postgres_skipped"] = str(exc)
    cluster, tracking_uri = None, f"sqlite:///{root / 'mlflow.db'}"
    os.environ.setdefault(*PREEMPTION_POLL)  # before the cluster: its processes inherit it
    import ray.cluster_utils  # what start_cluster imports: in this thread only

    importer = threading.Thread(target=import_sweep_modules, daemon=True)
    importer.start()  # while the cluster starts
    try:
        cluster = start_cluster(root)
        mark("cluster up")
        outcome["temp"] = temp_places(cluster, fresh)
        init_ray(quiet=True, address=cluster.address, log_to_driver=True)
        importer.join()
        mark("driver connected")
        if "reference" in scenarios and "outage" in scenarios:
            # One sweep for both (a sweep's start-up is most of a scenario's cost): the bucket
            # away mid-trial, waited out in place, is the run the others are compared with.
            outcome["reference"], server = bucket_outage(server, endpoint, storage,
                                                         tracking_uri, root, "reference")
        elif "reference" in scenarios:
            outcome["reference"] = run_sweep(sweep_config("reference", storage, tracking_uri,
                                                          *REFERENCE))
        if "reference" in scenarios:
            outcome["rerun"] = run_sweep(sweep_config("reference", storage, tracking_uri,
                                                      *REFERENCE))
        if "drained" in scenarios:
            outcome["drained"] = preempted_sweep(cluster, "drained", storage, tracking_uri,
                                                 root, preempt=True)
            # The autoscaler's replacement: it registers while the next sweep starts.
            add_worker_node(cluster, wait=False)
            mark("replacement node added")
        if "killed" in scenarios:
            outcome["killed"] = preempted_sweep(cluster, "killed", storage, tracking_uri, root,
                                                preempt=False)
        if mlflow is not None and postgres is not None:
            wait_for_mlflow(*mlflow)
            mark("mlflow (postgres) answers")
            outcome["postgres_uri"] = mlflow[1]
            outcome["postgres"] = four_trials(storage, mlflow[1], postgres[2])
            mark("four: runs read back")
        import boto3

        listed = boto3.client("s3", endpoint_url=f"http://{endpoint}").list_objects_v2(
            Bucket=BUCKET, Prefix="raycl/")
        outcome["bucket_keys"] = [item["Key"] for item in listed.get("Contents", [])]
    finally:
        mark("scenarios done, shutting down")
        (root / "outcome.json").write_text(json.dumps(outcome, indent=1))
        # The servers stop while the cluster does: each waits on processes that exit.
        stopper = threading.Thread(target=stop_servers, args=(server, mlflow, postgres))
        stopper.start()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        stopper.join()
        mark("shut down")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] or ["reference", "drained", "killed"])
