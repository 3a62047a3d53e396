"""`ddplab run -n N dist.fault_tolerance=live`: N replicas on this machine, each replaced when it fails,
the others going on meanwhile; and `ddplab lighthouse`, the server their quorums are formed by.

A replica is an ordinary one-process run of the plan (its own run folder `<run>/replica-<id>/`),
started with its settings told: its id (dist.replica_id + its place here), the lighthouse, its share
of the cores, its GPU. Without dist.lighthouse this process serves one for its replicas. A replica
that exits with an error is started again, up to --max-restarts times (default 3), and heals from a
peer; the run is over when every replica has ended. Its exit code: 0 when a replica finished.

A stop signal (SIGTERM from Kubernetes or scancel, SLURM's SIGUSR1, Ctrl-C) to this launcher or to
any one replica stops the whole job: each replica is told, saves at its next step and is not
replaced; the launcher then says what each saved, prints the command that continues, and exits 128+N."""

import contextlib
import ctypes
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from omegaconf import OmegaConf

from .. import environment
from ..errors import USER_ERROR_EXIT_CODE, DdplabError
from .plan import RunPlan
from .scratch import scratch_folder

# a replica silent this long is left out of the next quorum (the lighthouse's own default: 5 s)
HEARTBEAT_TIMEOUT_S = 2.0
# replacements per replica when --max-restarts is not given
DEFAULT_REPLACEMENTS = 3
# what tells a process which job it is a rank of: a replica is a job of one, whatever started this one
_JOB_VARIABLES = re.compile(
    r"(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|MASTER_PORT)$|(SLURM_|OMPI_|PMI_|PMIX_|TORCHELASTIC_|SM_)"
)


def is_live(plan: RunPlan) -> bool:
    return plan.entry is not None and plan.command == "run" and _settings(plan).dist.fault_tolerance == "live"


def _settings(plan: RunPlan):
    return OmegaConf.create(plan.config)


def count(opts) -> int:
    """This machine's replicas: -n (auto, gpu: one per GPU)."""
    if not opts.single_node:
        raise DdplabError(
            f"{opts.said('nnodes')} with dist.fault_tolerance=live: replicas meet at a lighthouse, not a rendezvous",
            "start `ddplab lighthouse` on one host, then on each node `ddplab run -n N ... dist.fault_tolerance=live "
            "dist.lighthouse=http://HOST:29510 dist.replica_id=FIRST` (FIRST: the node's first replica number)",
        )
    n = opts.nproc_per_node
    if n.isdigit():
        return int(n)
    return max(_gpus(), 1) if n in ("auto", "gpu") else 1


def launch_replicas(plan: RunPlan, count: int, max_restarts: int | None) -> int:
    """Run `count` replicas of the plan here until every one has ended; returns the run's exit code."""
    from ..distributed import live

    cfg = _settings(plan)
    lighthouse = None
    address = cfg.dist.lighthouse
    if address is None and cfg.dist.min_replicas > count:
        # the lighthouse this launch serves hears of its own replicas only
        raise DdplabError(
            f"dist.min_replicas={cfg.dist.min_replicas} needs that many replicas in each step, and -n {count} starts "
            f"{count}, meeting at a lighthouse of this launch that no other machine's replicas join",
            f"start -n {cfg.dist.min_replicas} or more, lower dist.min_replicas, or give every node's launch "
            "dist.lighthouse=http://HOST:29510 of one `ddplab lighthouse`",
        )
    if address is None:
        lighthouse = live.serve_lighthouse("127.0.0.1:0", cfg.dist.min_replicas)
        address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    live.wait_for_lighthouse(address, cfg.dist.timeout_s)
    replacements = DEFAULT_REPLACEMENTS if max_restarts is None else max_restarts
    first = cfg.dist.replica_id
    print(f"ddplab: {count} replica(s) ({first}..{first + count - 1}) meeting at the lighthouse {address}", flush=True)
    # where the replicas started together meet before their first quorum (distributed/live.py)
    try:
        with scratch_folder("ddplab-replicas-") as start:
            group = Replicas(plan, cfg, address, count, start)
            try:
                return group.run(replacements)
            finally:
                group.stop()
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()


class Replicas:
    """This machine's replicas: started, watched, replaced."""

    def __init__(self, plan: RunPlan, cfg, lighthouse: str, count: int, start: str):
        # the signal that stopped the job, once one came (to this process or to a replica), and
        # when the replicas that have not saved by then are ended
        self.stopped_by: str | None = None
        self.stop_deadline = float("inf")
        self.plan = plan
        self.cfg = cfg
        self.lighthouse = lighthouse
        self.count = count
        self.start_folder = start
        self.procs: dict[int, subprocess.Popen] = {}
        self.ended: dict[int, int] = {}

    def run(self, replacements: int) -> int:
        first = self.cfg.dist.replica_id
        for place in range(self.count):
            self.start(first + place, place)
        used = dict.fromkeys(self.procs, 0)
        with self._stop_signals_passed_on():
            while self.procs:
                time.sleep(0.1)
                self._end_those_that_cannot_stop()
                for replica, proc in list(self.procs.items()):
                    if (code := proc.poll()) is not None:
                        del self.procs[replica]
                        if self._replace(replica, code, used[replica] < replacements):
                            used[replica] += 1
                            print(
                                f"ddplab: replica {replica} failed (exit code {code}); starting its replacement "
                                f"({used[replica]} of at most {replacements}), the others go on",
                                flush=True,
                            )
                            self.start(replica, replica - first)
        return self._outcome()

    def _replace(self, replica: int, code: int, may: bool) -> bool:
        """Whether a replica that ended with CODE is replaced (MAY: it has replacements left)."""
        from ..distributed import live

        stopped = self._stopped(replica, code)
        if stopped and self.stopped_by is None:
            # a signal to one replica (a node's OOM watcher, a user's kill) stops the job
            self._on_signal(signal.Signals[stopped].value, None)
        # after a peer's last step a replacement would find nobody to heal from (one that
        # failed after its own last step, in its export say, resumes there and is replaced)
        finished = [r for r in live.finished_replicas(self.start_folder) if r != replica]
        if code not in (0, USER_ERROR_EXIT_CODE) and not self.stopped_by and may and not finished:
            return True
        self.ended[replica] = code
        # its peers no longer wait for it to begin
        live.arrived(self.start_folder, replica)
        if code not in (0, USER_ERROR_EXIT_CODE) and finished:
            print(
                f"ddplab: replica {replica} failed (exit code {code}) after replica(s) {finished} "
                "finished the run; not replaced",
                flush=True,
            )
        return False

    def start(self, replica: int, place: int) -> None:
        from ..distributed.runtime import cpu_threads_per_rank

        cfg = self.cfg.copy()
        if not cfg.dist.cpu_threads:
            cfg.dist.cpu_threads = cpu_threads_per_rank(self.count)
        # its errors are its own to print, in one line
        # where it says what it saved when a signal stops it (launch/stops.py)
        stop_file = self._note(replica)
        plan = dataclasses.replace(self.plan, config=OmegaConf.to_yaml(cfg), launcher_pid=None, stop_file=stop_file)
        env = {k: v for k, v in os.environ.items() if not _JOB_VARIABLES.match(k)}
        env[environment.PLAN] = json.dumps(dataclasses.asdict(plan))
        env[environment.REPLICA_ID] = str(replica)
        env[environment.LIGHTHOUSE] = self.lighthouse
        env[environment.REPLICAS_START] = f"{self.start_folder}:{self.count}"
        # the summary's resume command starts every replica of this machine again
        env[environment.LAUNCH_FLAGS] = f"-n {self.count}"
        if gpus := _visible_gpus():
            env[environment.VISIBLE_GPUS] = gpus[place % len(gpus)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "ddplab.launch.worker"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_end_with_this_process,
        )
        threading.Thread(target=_relay, args=(proc, f"[replica {replica}] "), daemon=True).start()
        self.procs[replica] = proc

    def _note(self, replica: int) -> str:
        return os.path.join(self.start_folder, f"stop-{replica}.json")

    def _stopped(self, replica: int, code: int) -> str | None:
        """The signal a replica that ended saved and stopped for, if it did (its note says so)."""
        from ..train.rundir import read_json

        name = read_json(self._note(replica)).get("signal")
        return name if name and code == 128 + signal.Signals[name].value else None

    @contextlib.contextmanager
    def _stop_signals_passed_on(self):
        """While the replicas run, this launcher's stop signals go to every one of them (only the
        main thread may take signals); then the handlers are given back."""
        preempt = OmegaConf.select(self.cfg, "checkpoint.preempt_signals", default="")
        names = {n.strip() for n in preempt.split(",")} | {"SIGTERM", "SIGINT"}
        mine = threading.current_thread() is threading.main_thread()
        previous = {name: signal.signal(signal.Signals[name], self._on_signal) for name in names - {""} if mine}
        try:
            yield
        finally:
            for name, handler in previous.items():
                signal.signal(signal.Signals[name], handler)

    def _on_signal(self, signum, frame) -> None:
        if self.stopped_by is not None and frame is not None:
            # a second signal to this launcher: no more waiting for the replicas' saves
            self.stop_deadline = 0.0
        if self.stopped_by is None:
            self.stopped_by = signal.Signals(signum).name
            self.stop_deadline = time.monotonic() + self.cfg.dist.timeout_s
        for proc in self.procs.values():
            # (ended meanwhile)
            with contextlib.suppress(OSError):
                proc.send_signal(signum)

    def _end_those_that_cannot_stop(self) -> None:
        """Replicas told to stop save at their next step; one that cannot get there (waiting for a
        quorum, for a peer) is ended dist.timeout_s after the signal, or at a second signal."""
        if self.stopped_by is None or time.monotonic() < self.stop_deadline:
            return
        for proc in self.procs.values():
            proc.kill()

    def _stop_report(self) -> int:
        """After a stop: what each replica saved, and the command that continues the job."""
        from ..train.rundir import read_json
        from .stops import resume_command

        said = []
        for replica in sorted(self.ended):
            note = read_json(self._note(replica))
            if note.get("signal"):
                said.append(f"replica {replica} saved a checkpoint at step {note['step']} in {note['run_dir']}")
                if note.get("not_uploaded"):
                    said[-1] += f" (not in its bucket: {note['not_uploaded']})"
            else:
                said.append(f"replica {replica} saved nothing at the stop (checkpoints written before it remain)")
        print(
            f"ddplab: stopped by {self.stopped_by}; {'; '.join(said)}. To continue: {resume_command(self.plan)}",
            file=sys.stderr,
            flush=True,
        )
        return 128 + signal.Signals[self.stopped_by].value

    def _outcome(self) -> int:
        finished = [r for r, code in self.ended.items() if code == 0]
        if self.stopped_by and not finished:
            return self._stop_report()
        failed = {r: code for r, code in self.ended.items() if code != 0}
        if failed and finished:
            print(f"ddplab: replica(s) {sorted(failed)} ended with an error; {finished} finished the run", flush=True)
        if finished:
            return 0
        return USER_ERROR_EXIT_CODE if USER_ERROR_EXIT_CODE in failed.values() else max(failed.values(), default=1)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _relay(proc: subprocess.Popen, prefix: str) -> None:
    """A replica's output, each line labelled with its replica."""
    for line in proc.stdout:
        sys.stdout.write(prefix + line)
        sys.stdout.flush()


def _end_with_this_process() -> None:
    """In the replica, before it runs: end it when this launcher dies (PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").prctl(1, int(signal.SIGKILL))


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _visible_gpus() -> list[str]:
    """The GPUs this launcher may hand out, one to each replica (none on a CPU machine)."""
    if given := os.environ.get(environment.VISIBLE_GPUS):
        return given.split(",")
    return [str(i) for i in range(_gpus())]


def add_command(sub) -> None:
    server = sub.add_parser(
        "lighthouse",
        help="serve the lighthouse that forms the quorums of dist.fault_tolerance=live replicas, until stopped",
    )
    server.add_argument("--port", type=int, default=29510, help="port to listen on (default 29510)")
    server.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    server.add_argument("--min-replicas", type=int, default=1, help="replicas a quorum needs (default 1)")
    server.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=HEARTBEAT_TIMEOUT_S,
        help="a replica silent this long is left out of the next quorum (default 2)",
    )
    server.set_defaults(
        handler=lambda args, rest: serve(args.host, args.port, args.min_replicas, args.heartbeat_timeout_s)
    )


def serve(host: str, port: int, min_replicas: int, heartbeat_timeout_s: float) -> int:
    """Serve a lighthouse until SIGINT or SIGTERM."""
    from ..distributed import live

    if min_replicas < 1:
        raise DdplabError(f"--min-replicas {min_replicas} is below 1", "pass --min-replicas 1 or more")
    server = live.serve_lighthouse(f"{host}:{port}", min_replicas, int(heartbeat_timeout_s * 1000))
    print(
        f"ddplab: lighthouse at http://{host}:{port} (quorums of at least {min_replicas}); stop with Ctrl-C", flush=True
    )
    stopped = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopped.set())
    stopped.wait()
    server.shutdown()
    return 0
