"""Checkpoints of the training stages: resume only a matching partial run; the final file replaces it."""

from __future__ import annotations

import pytest
import torch

from rlflow.agents.checkpoint import Checkpointer, fingerprint, load_checkpoint
from rlflow.errors import RLFlowError


def test_resume_only_with_the_same_fingerprint(tmp_path):
    out = tmp_path / "model.pt"
    a = Checkpointer(out, fingerprint({"lr": 0.1}))
    assert a.load() is None
    a.save({"epoch": 3, "w": torch.ones(2)})
    state = Checkpointer(out, fingerprint({"lr": 0.1})).load()
    assert state["epoch"] == 3 and torch.equal(state["w"], torch.ones(2))
    assert Checkpointer(out, fingerprint({"lr": 0.2})).load() is None  # another config: start over
    assert not out.exists()  # only the partial file so far


def test_fingerprint_covers_input_files(tmp_path):
    f = tmp_path / "in.bin"
    f.write_bytes(b"one")
    fp1 = fingerprint({}, [f])
    f.write_bytes(b"two")
    assert fingerprint({}, [f]) != fp1


def test_finish_writes_the_final_file_and_drops_the_partial(tmp_path):
    out = tmp_path / "sub" / "model.pt"
    c = Checkpointer(out, "fp")
    c.save({"epoch": 1})
    assert c.partial.exists()
    c.finish({"model": {"w": torch.zeros(3)}, "config": {"lr": 0.1}})
    assert not c.partial.exists()
    data = load_checkpoint(out)
    assert data["config"] == {"lr": 0.1} and torch.equal(data["model"]["w"], torch.zeros(3))


def test_bad_final_is_one_line_error(tmp_path):
    with pytest.raises(RLFlowError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")
    out = tmp_path / "model.pt"
    out.write_bytes(b"garbage")
    with pytest.raises(RLFlowError, match="not a readable checkpoint"):
        load_checkpoint(out)


@pytest.mark.parametrize("damage", [
    lambda p: p.write_bytes(b"not a checkpoint"),
    lambda p: p.write_bytes(p.read_bytes()[:40]),  # truncated
    lambda p: torch.save([1, 2], p),  # readable, but no rlflow partial state
    lambda p: torch.save({"epoch": 2}, p),  # no fingerprint
])
def test_damaged_partial_is_a_one_line_error_naming_it(tmp_path, damage):
    """A resumable checkpoint that cannot be read is never dropped silently: the error names the file and says
    to delete it; the file is left as it is."""
    c = Checkpointer(tmp_path / "model.pt", "fp")
    c.save({"epoch": 1, "w": torch.ones(3)})
    damage(c.partial)
    before = c.partial.read_bytes()
    with pytest.raises(RLFlowError) as err:
        c.load()
    msg = str(err.value)
    assert msg.startswith(f"{c.partial}: the resumable checkpoint of an interrupted run cannot be read (")
    assert msg.endswith("; delete it to start over") and "\n" not in msg
    assert c.partial.read_bytes() == before
    c.partial.unlink()
    assert c.load() is None  # deleted: a fresh start
