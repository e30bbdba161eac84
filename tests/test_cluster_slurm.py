"""The tiny pipeline (rule all) on a real SLURM cluster: a single-node cluster started on this machine from
Debian's packages (tests/slurm_cluster.py), Snakemake driven by the shipped SLURM profile through the official
executor plugin (snakemake-executor-plugin-slurm, pinned in envs/requirements-cluster.txt). The test checks in
SLURM's accounting (`sacct`) that every pipeline job was a SLURM job that completed, on the partition the profile
gives its rule, and that the outputs are right: the report and the evaluation table as the local tiny end-to-end
run checks them, and the deterministic outputs (exported model, rules) byte-equal to a local run's.

Not part of `make test` (it installs system packages and takes minutes): `make test-cluster` runs it
(pytest --run-cluster). It skips, with the reason, where SLURM is missing and cannot be installed (no root, no apt).

The shipped profile holds a site's values; the test runs a copy of it with only those changed for this one small
node (`profile_for_test_node`): the account is the test cluster's, a job asks for 1 CPU and at most 1.5 GB (the profile
asks up to 8 CPUs and 16 GB, more than this node has), no `gres` (no GPU here), SLURM logs kept, and the first
status check after 5 s instead of the plugin's 40. The partitions, runtimes and per-rule assignments stay."""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import re
import subprocess
import time

import pytest
import yaml
from slurm_cluster import ACCOUNT, ClusterBusy, ClusterError, SlurmCluster, install_reason
from test_pipeline import CONFIG, ENV, REPO, TINY, copy_workflow, job_counts, sh, tool

from rlflow.config import load_config

pytestmark = pytest.mark.cluster

PROFILE = REPO / "workflow" / "profiles" / "slurm" / "config.yaml"
#: what one job may ask of the test node (2 cores, 4 GB): two jobs run at once
JOB_CPUS, JOB_MEM_MB, NODE_MEM_MB = 1, 1500, 4096
#: rules Snakemake runs on the submitting machine, not as SLURM jobs (rule all has no command)
LOCAL_RULES = {"all"}
#: files that depend on no timing, so a SLURM run and a local run make the same bytes
DETERMINISTIC = ["results/bert/model.onnx", "results/rules/rules.json"]


def profile_for_test_node(shipped: dict) -> dict:
    """The shipped SLURM profile with this test node's values: the test cluster's account, JOB_CPUS and at most
    JOB_MEM_MB per job, no GPU gres; SLURM logs kept; first status check after 5 s."""
    prof = yaml.safe_load(yaml.safe_dump(shipped))

    def fit(res: dict) -> dict:
        res = {k: v for k, v in res.items() if k != "gres"}
        if "cpus_per_task" in res:
            res["cpus_per_task"] = JOB_CPUS
        if "mem_mb" in res:
            res["mem_mb"] = min(res["mem_mb"], JOB_MEM_MB)
        return res

    prof["default-resources"] = fit({**prof["default-resources"], "slurm_account": ACCOUNT})
    prof["set-resources"] = {rule: fit(res) for rule, res in prof["set-resources"].items()}
    prof["slurm-keep-successful-logs"] = True
    prof["slurm-init-seconds-before-status-checks"] = 5
    return prof


def rule_of(comment: str) -> str:
    """The rule name in the plugin's job comment (`rule_NAME` or `rule_NAME_wildcards_...`)."""
    m = re.fullmatch(r"rule_(.+?)(?:_wildcards_.*)?", comment)
    assert m, comment
    return m.group(1)


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        pytest.skip("snakemake-executor-plugin-slurm is not installed (make test-cluster installs it)")
    reason = install_reason()
    if reason:
        pytest.skip(reason)
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), cpus=2, memory_mb=NODE_MEM_MB)
    try:
        c.start()
    except ClusterBusy as e:
        pytest.skip(f"cannot start a test SLURM cluster here: {e}")
    except ClusterError as e:
        pytest.fail(f"the test cluster did not start: {e}")
    yield c
    c.stop()


def tiny_config() -> dict:
    """The tiny end-to-end run's config (tests/test_pipeline_e2e.py): tiny sizes, one temperature, one reward."""
    cfg = load_config([CONFIG, TINY])
    cfg["sweeps"] = {"temperatures": [0.5], "rewards": ["delta"]}
    return cfg


@pytest.fixture(scope="module")
def slurm_run(cluster, tmp_path_factory):
    """rule all on the tiny config through SLURM: (workflow copy, snakemake's output, seconds)."""
    root = tmp_path_factory.mktemp("slurm-repo")
    copy_workflow(root)
    (root / "config.yaml").write_text(yaml.safe_dump(tiny_config(), sort_keys=False))
    prof = root / "test-profiles" / "slurm"
    prof.mkdir(parents=True)
    (prof / "config.yaml").write_text(yaml.safe_dump(profile_for_test_node(yaml.safe_load(PROFILE.read_text()))))
    snakemake = tool("snakemake")
    start = time.monotonic()
    r = cluster_sh(cluster, snakemake, "--workflow-profile", prof, cwd=root, timeout=3000)
    seconds = time.monotonic() - start
    print(f"snakemake through SLURM: {seconds:.0f} s")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:] + cluster.logs("slurmctld")
    return root, r.stdout + r.stderr, seconds


def cluster_sh(cluster, *args, cwd, timeout):
    """`sh` (tests/test_pipeline.py) with the cluster's SLURM_CONF and the SLURM commands on PATH: sbatch passes
    this environment on to the jobs (--export=ALL), PYTHONPATH and the venv's PATH included."""
    env = {**ENV, "SLURM_CONF": cluster.env["SLURM_CONF"], "PATH": f"{ENV['PATH']}:/usr/sbin:/sbin"}
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def accounting(cluster, slurm_run):
    """sacct's record of every job the cluster ran: dicts with JobID, Comment, Partition, Account, State,
    ExitCode, NodeList."""
    fields = ["JobIDRaw", "JobName", "Comment", "Partition", "Account", "State", "ExitCode", "NodeList"]
    r = cluster.run("sacct", "-X", "--allusers", "--parsable2", "--noheader", "--starttime", "now-1days",
                    f"--format={','.join(f + '%200' if f == 'Comment' else f for f in fields)}")
    jobs = [dict(zip(fields, line.split("|"))) for line in r.stdout.splitlines() if line]
    print(f"sacct: {len(jobs)} SLURM jobs")
    return jobs


def test_every_pipeline_job_ran_as_a_completed_slurm_job(slurm_run, accounting):
    root, log, _ = slurm_run
    ran = job_counts(log)
    expected = collections.Counter({rule: n for rule, n in ran.items() if rule not in LOCAL_RULES})
    assert {"export_model", "generate_rules", "collect_rollouts", "train_controller", "evaluate", "report",
            "summary"} <= set(expected), ran  # the whole tiny pipeline, not a handful of jobs
    assert accounting, "sacct lists no job"
    in_slurm = collections.Counter(rule_of(job["Comment"]) for job in accounting)
    assert in_slurm == expected, (in_slurm, expected)
    assert {job["State"] for job in accounting} == {"COMPLETED"}, accounting
    assert {job["ExitCode"] for job in accounting} == {"0:0"}, accounting
    assert {job["Account"] for job in accounting} == {ACCOUNT}
    assert {job["NodeList"] for job in accounting} == {"localhost"}
    assert len({job["JobName"] for job in accounting}) == 1  # the plugin names every job by the run's id


def test_each_job_ran_on_the_partition_the_profile_gives_its_rule(accounting):
    prof = yaml.safe_load(PROFILE.read_text())
    default = prof["default-resources"]["slurm_partition"]
    for job in accounting:
        rule = rule_of(job["Comment"])
        want = prof["set-resources"].get(rule, {}).get("slurm_partition", default)
        assert job["Partition"] == want, (rule, job)
    assert {job["Partition"] for job in accounting} == {"cpu", "gpu"}  # both kinds of rule ran


def test_the_slurm_run_built_the_report(slurm_run):
    import csv

    root, log, _ = slurm_run
    html = (root / "results/bert/report.html").read_text()
    assert html.lstrip().lower().startswith("<!doctype html") and "</html>" in html
    missing = set(re.findall(r"stage (\w+) has not run", html))  # stages outside rule all (XLA, ...) say so
    assert not missing & set(job_counts(log)), f"the report misses stages that ran: {missing}"
    assert (root / "results/summary.html").is_file() and (root / "results/summary.csv").is_file()
    with open(root / "results/bert/evaluation.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["method"] for r in rows} >= {"original", "taso", "greedy", "eqsat", "model_free", "rlflow"}
    assert all(r["status"] in ("ok", "unsupported") for r in rows)
    assert all(float(r["max_rel_diff"]) <= 1e-4 for r in rows if r["status"] == "ok")
    logs = list((root / ".snakemake" / "slurm_logs").rglob("*.log"))
    assert logs, "no SLURM job log"


def test_deterministic_outputs_equal_a_local_runs(slurm_run, tmp_path):
    root, _, _ = slurm_run
    copy_workflow(tmp_path)
    (tmp_path / "config.yaml").write_text((root / "config.yaml").read_text())
    r = sh(tool("snakemake"), *DETERMINISTIC, "--cores", "2", cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for path in DETERMINISTIC:
        assert digest(tmp_path / path) == digest(root / path), path
