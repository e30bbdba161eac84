"""A throwaway single-node SLURM cluster on this machine, for tests/test_cluster_slurm.py.

Debian's packages (slurmctld, slurmd, slurmdbd, munge, mariadb-server), every daemon started directly in the
foreground (no systemd), every file under one folder: the configuration (SLURM_CONF points clients and daemons at
it), state, spool, logs, the MariaDB data and the MUNGE key and socket. One thing outside it: a link at the
default config path, /etc/slurm/slurm.conf, for the `srun` inside each job (see `_link_default_config`); start
refuses (ClusterBusy) where that path is taken, and stop removes the link. Everything listens on 127.0.0.1 only, on
ports picked free at start. Job accounting (what `sacct` reads, and what the Snakemake SLURM executor polls for
job states) goes through slurmdbd into a local MariaDB: SLURM keeps no accounting without it.

    cluster = SlurmCluster(folder, cpus=2, memory_mb=4096)
    cluster.start()          # raises ClusterError (with the failing daemon's log) if a daemon does not come up
    cluster.run("sinfo")     # any client, with the cluster's environment
    cluster.stop()           # SIGTERM to every daemon it started (by pid), then SIGKILL after a grace period

The partitions are named like the shipped profile's (`cpu`, `gpu`) and both hold the one node: this machine has no
GPU, so a job sent to `gpu` lands on the same CPUs (the test drops the profile's `gres`)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

#: Debian's packages that provide the daemons and clients, and the commands the cluster needs from them
PACKAGES = ["slurmctld", "slurmd", "slurmdbd", "slurm-client", "munge", "mariadb-server", "mariadb-client"]
COMMANDS = ["slurmctld", "slurmd", "slurmdbd", "sbatch", "sacct", "sacctmgr", "scontrol", "scancel", "squeue",
            "munged", "mungekey", "mariadbd", "mariadb-install-db", "mariadb"]
CLUSTER = "rlflowtest"
ACCOUNT = "rlflow-test"


#: where SLURM's commands look for the config when SLURM_CONF is not set
DEFAULT_CONF = Path("/etc/slurm/slurm.conf")


class ClusterError(RuntimeError):
    pass


class ClusterBusy(ClusterError):
    """The machine's default SLURM config path is taken: the test cluster cannot run here now."""


def missing_commands() -> list[str]:
    return [c for c in COMMANDS if shutil.which(c, path=_sbin_path()) is None]


def _sbin_path() -> str:
    path = os.environ.get("PATH", "")
    return os.pathsep.join([path, "/usr/sbin", "/usr/bin", "/sbin"])


def install_reason() -> str | None:
    """Install the Debian packages when a command is missing. Returns None when every command is there (after
    installing if needed), else a one-line reason the cluster cannot run here."""
    if not missing_commands():
        return None
    if os.geteuid() != 0:
        return f"SLURM is not installed ({', '.join(missing_commands())} missing) and installing it needs root"
    if shutil.which("apt-get") is None:
        return f"SLURM is not installed ({', '.join(missing_commands())} missing) and there is no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["?"]
            return f"`{' '.join(cmd[:2])}` failed: {tail[0]}"
    if missing_commands():
        return f"installed {' '.join(PACKAGES)} but still missing {', '.join(missing_commands())}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, folder: Path, cpus: int = 2, memory_mb: int = 4096):
        self.dir = Path(folder)
        self.cpus = cpus
        self.memory_mb = memory_mb
        self.procs: dict[str, subprocess.Popen] = {}
        self.conf = self.dir / "etc" / "slurm.conf"
        self.db_password = secrets.token_hex(12)

    # -- environment ------------------------------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF and the sbin folder; pass it to every client (sbatch inherits it, and with
        it the jobs)."""
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": _sbin_path()}

    def run(self, *cmd: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise ClusterError(f"{' '.join(cmd)} exited {r.returncode}: {r.stdout}{r.stderr}")
        return r

    # -- lifecycle --------------------------------------------------------------------------------------------
    def start(self) -> None:
        for sub in ("etc", "state", "spool", "log", "run", "db"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)  # munged refuses a socket or key folder others can write to
        ports = {name: _free_port() for name in ("ctld", "slurmd", "dbd", "mysql")}
        self._write_config(ports)
        self._link_default_config()
        try:
            self._start_munge()
            self._start_mariadb(ports["mysql"])
            self._start_daemon("slurmdbd", ["slurmdbd", "-D"], lambda: self._port_open(ports["dbd"]))
            self.run("sacctmgr", "-i", "add", "cluster", CLUSTER)
            self.run("sacctmgr", "-i", "add", "account", ACCOUNT, f"Cluster={CLUSTER}", "Description=tests",
                     "Organization=rlflow")
            self.run("sacctmgr", "-i", "add", "user", _user(), f"Account={ACCOUNT}", f"Cluster={CLUSTER}")
            self._start_daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)],
                               lambda: self.run("scontrol", "ping", check=False).returncode == 0)
            self._start_daemon("slurmd", ["slurmd", "-D", "-N", "localhost", "-f", str(self.conf)],
                               self._node_idle)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel any job still queued or running (a run that failed or timed out leaves them), stop the daemons
        in reverse start order (slurmd, slurmctld, slurmdbd, MariaDB, munged) and remove the link at the default
        config path."""
        try:
            if "slurmd" in self.procs and self.procs["slurmctld"].poll() is None:
                self._cancel_jobs()
            self._stop_daemons()
        finally:
            if DEFAULT_CONF.is_symlink() and Path(os.readlink(DEFAULT_CONF)) == self.conf:
                DEFAULT_CONF.unlink()

    def _cancel_jobs(self, timeout: float = 60) -> None:
        self.run("scancel", "--user", _user(), check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.run("squeue", "--noheader", check=False)
            if r.returncode != 0 or not r.stdout.strip():
                return
            time.sleep(1)

    def _stop_daemons(self) -> None:
        for name in reversed(list(self.procs)):
            p = self.procs.pop(name)
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=10)

    def __enter__(self) -> "SlurmCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- pieces -----------------------------------------------------------------------------------------------
    def _write_config(self, ports: dict[str, int]) -> None:
        d, user = self.dir, _user()
        auth = f"AuthType=auth/munge\nAuthInfo=socket={d}/run/munge.socket\n"
        self.conf.write_text(
            f"ClusterName={CLUSTER}\n"
            f"SlurmctldHost=localhost(127.0.0.1)\n"
            f"SlurmctldPort={ports['ctld']}\nSlurmdPort={ports['slurmd']}\n"
            f"{auth}CredType=cred/munge\n"
            f"SlurmUser={user}\nSlurmdUser={user}\n"
            f"StateSaveLocation={d}/state\nSlurmdSpoolDir={d}/spool\n"
            f"SlurmctldPidFile={d}/run/slurmctld.pid\nSlurmdPidFile={d}/run/slurmd.pid\n"
            f"SlurmctldLogFile={d}/log/slurmctld.log\nSlurmdLogFile={d}/log/slurmd.log\n"
            # no cgroups in a container without systemd: track processes by /proc, bind no tasks
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/linux\n"
            "MpiDefault=none\nReturnToService=2\nSchedulerType=sched/backfill\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core_Memory\n"
            f"AccountingStorageType=accounting_storage/slurmdbd\nAccountingStorageHost=127.0.0.1\n"
            f"AccountingStoragePort={ports['dbd']}\nJobCompType=jobcomp/none\n"
            # what clients and slurmctld authenticate to slurmdbd with: here the same MUNGE socket
            f"AccountingStoragePass={d}/run/munge.socket\n"
            "AccountingStoreFlags=job_comment\n"  # the executor plugin's comment names the job's rule
            f"NodeName=localhost NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN\n"
            "PartitionName=cpu Nodes=localhost Default=YES MaxTime=INFINITE State=UP\n"
            "PartitionName=gpu Nodes=localhost MaxTime=INFINITE State=UP\n")
        dbd = self.conf.parent / "slurmdbd.conf"  # slurmdbd reads it from SLURM_CONF's folder
        dbd.write_text(
            f"{auth}DbdHost=localhost\nDbdAddr=127.0.0.1\nDbdPort={ports['dbd']}\nSlurmUser={user}\n"
            f"PidFile={d}/run/slurmdbd.pid\nLogFile={d}/log/slurmdbd.log\n"
            "StorageType=accounting_storage/mysql\nStorageHost=127.0.0.1\n"
            f"StoragePort={ports['mysql']}\nStorageUser=slurm\nStoragePass={self.db_password}\n"
            "StorageLoc=slurm_acct_db\n")
        dbd.chmod(0o600)  # slurmdbd refuses a config others can read (it holds the database password)

    def _link_default_config(self) -> None:
        """Link the default config path to this cluster's config. Inside a job, the executor plugin's jobstep
        (snakemake-executor-plugin-slurm-jobstep) removes SLURM_CONF from the environment of the `srun` it
        starts, so srun reads the default path, as on a real cluster's nodes."""
        if DEFAULT_CONF.is_symlink() and not DEFAULT_CONF.exists():
            DEFAULT_CONF.unlink()  # left by a test cluster that was killed
        if DEFAULT_CONF.exists() or DEFAULT_CONF.is_symlink():
            raise ClusterBusy(f"{DEFAULT_CONF} exists (this machine's own SLURM, or another test cluster running)")
        DEFAULT_CONF.parent.mkdir(parents=True, exist_ok=True)
        DEFAULT_CONF.symlink_to(self.conf)

    def _start_munge(self) -> None:
        key = self.dir / "etc" / "munge.key"
        self.run("mungekey", "--create", f"--keyfile={key}")
        key.chmod(0o600)
        run = self.dir / "run"
        self._start_daemon(
            "munged",
            ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={run}/munge.socket",
             f"--pid-file={run}/munged.pid", f"--seed-file={run}/munged.seed",
             f"--log-file={self.dir}/log/munged.log"],
            lambda: (run / "munge.socket").exists())

    def _start_mariadb(self, port: int) -> None:
        data, sock = self.dir / "db", self.dir / "run" / "mysql.sock"
        user = _user()
        self.run("mariadb-install-db", "--no-defaults", f"--datadir={data}", f"--user={user}",
                 "--auth-root-authentication-method=socket", "--skip-test-db", timeout=180)
        self._start_daemon(
            "mariadb",
            ["mariadbd", "--no-defaults", f"--datadir={data}", f"--socket={sock}", f"--port={port}",
             "--bind-address=127.0.0.1", "--skip-name-resolve", f"--user={user}",
             f"--pid-file={self.dir}/run/mysqld.pid", f"--log-error={self.dir}/log/mariadb.log",
             "--innodb-buffer-pool-size=64M", "--innodb-lock-wait-timeout=900"],
            lambda: self.run("mariadb", "--no-defaults", "-S", str(sock), "-u", "root", "-e", "SELECT 1",
                             check=False).returncode == 0)
        self.run("mariadb", "--no-defaults", "-S", str(sock), "-u", "root", "-e",
                 f"CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{self.db_password}';"
                 "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';")

    def _start_daemon(self, name: str, cmd: list[str], ready, timeout: float = 60) -> None:
        log = open(self.dir / "log" / f"{name}.out", "w")
        self.procs[name] = p = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if p.poll() is not None:
                raise ClusterError(f"{name} exited {p.returncode} while starting:\n{self.logs(name)}")
            if ready():
                return
            time.sleep(0.5)
        raise ClusterError(f"{name} not ready after {timeout:.0f} s:\n{self.logs(name)}")

    def _port_open(self, port: int) -> bool:
        with socket.socket() as s:
            s.settimeout(1)
            return s.connect_ex(("127.0.0.1", port)) == 0

    def _node_idle(self) -> bool:
        r = self.run("sinfo", "-h", "-N", "-o", "%t", check=False)
        return r.returncode == 0 and r.stdout.split()[:1] == ["idle"]

    def logs(self, name: str, tail: int = 40) -> str:
        """The last lines of a daemon's log files (its own log and its stdout/stderr)."""
        out = []
        for path in sorted((self.dir / "log").glob(f"{name}*")):
            lines = path.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(out)


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name
