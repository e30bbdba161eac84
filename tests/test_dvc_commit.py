"""rlflow.pipeline.dvc.commit: what Snakemake's onsuccess runs to record a run in dvc.lock, in one pass."""

from __future__ import annotations

import pytest
import yaml

from rlflow.errors import RLFlowError
from rlflow.pipeline.dvc import commit

DVC_YAML = {"stages": {
    "make": {"foreach": ["a", "b"], "do": {"cmd": "cp in.txt out-${item}.txt", "deps": ["in.txt"],
                                           "outs": ["out-${item}.txt"]}},
    "join": {"cmd": "cat out-a.txt out-b.txt > joined.txt", "deps": ["out-a.txt", "out-b.txt"],
             "outs": ["joined.txt"]},
}}


@pytest.fixture
def repo(tmp_path):
    from dvc.repo import Repo

    Repo.init(str(tmp_path), no_scm=True).close()
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML))
    (tmp_path / "in.txt").write_text("x\n")
    for name in ("out-a.txt", "out-b.txt"):
        (tmp_path / name).write_text("x\n")
    (tmp_path / "joined.txt").write_text("x\nx\n")
    return tmp_path


def status(root):
    from dvc.repo import Repo

    with Repo(str(root)) as r:  # its keys are relative to the current folder: the names alone
        return {name.split(":")[-1] for name in r.status()}


def test_the_named_stages_are_recorded_and_up_to_date(repo):
    assert status(repo) == {"make@a", "make@b", "join"}  # never run: all changed
    commit(["make@a", "join"], repo)
    assert status(repo) == {"make@b"}
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert set(lock) == {"make@a", "join"}
    assert lock["join"]["outs"][0]["md5"] and lock["make@a"]["deps"][0]["path"] == "in.txt"
    (repo / "out-a.txt").write_text("y\n")  # a changed output is recorded as it now is
    commit(["make@a", "make@b"], repo)
    assert status(repo) == {"join"}  # its input changed since its own record


def test_an_unknown_stage_or_a_missing_output_is_an_error_and_records_nothing(repo):
    with pytest.raises(RLFlowError, match="no DVC stage named make@c, nope under"):
        commit(["make@a", "nope", "make@c"], repo)
    (repo / "joined.txt").unlink()
    with pytest.raises(RLFlowError, match="dvc: .*joined.txt"):
        commit(["join"], repo)
    assert not (repo / "dvc.lock").exists()
