"""tx.training.step_dirs on a temporary directory: commit writes the state and then LATEST, latest() follows LATEST
(not the newest directory on disk), rotation keeps the newest `keep`, and resume_dir resolves 'latest', '' and
a path."""

import json

from tx.training import step_dirs


def test_commit_writes_state_then_latest(tmp_path):
    root = tmp_path / "ckpt"
    assert step_dirs.latest(root) is None  # nothing saved yet
    d = step_dirs.commit(root, 3, {"step": 3, "runs": ["a"]})
    assert d == root / "global_step_3" and d.is_dir()
    assert json.loads((d / "trainer_state.json").read_text()) == {"step": 3, "runs": ["a"]}
    assert (root / "latest_ckpt_global_step.txt").read_text() == "3"
    assert step_dirs.latest(root) == d
    assert step_dirs.read_state(d) == {"step": 3, "runs": ["a"]}


def test_an_uncommitted_step_directory_is_not_the_latest(tmp_path):
    root = tmp_path / "ckpt"
    step_dirs.commit(root, 2, {"step": 2})
    (step_dirs.step_dir(root, 4) / "policy").mkdir(parents=True)  # a save that crashed before commit
    assert step_dirs.latest(root) == root / "global_step_2"
    assert step_dirs.resume_dir(root, "latest") == root / "global_step_2"


def test_rotation_keeps_the_newest(tmp_path):
    root = tmp_path / "ckpt"
    for step in (1, 2, 10, 11):  # 10 sorts after 2 by number, not by name
        step_dirs.commit(root, step, {"step": step}, keep=2)
    assert sorted(p.name for p in root.glob("global_step_*")) == ["global_step_10", "global_step_11"]
    all_kept = tmp_path / "all"
    for step in (1, 2, 3):
        step_dirs.commit(all_kept, step, {"step": step}, keep=0)  # 0 (or -1): keep every checkpoint
    step_dirs.commit(all_kept, 4, {"step": 4}, keep=-1)
    assert len(list(all_kept.glob("global_step_*"))) == 4


def test_resume_dir(tmp_path):
    root = tmp_path / "ckpt"
    assert step_dirs.resume_dir(root, "") is None
    assert step_dirs.resume_dir(root, None) is None
    assert step_dirs.resume_dir(root, "latest") is None  # nothing saved: start fresh
    assert step_dirs.resume_dir(None, "latest") is None
    assert step_dirs.resume_dir(root, str(tmp_path / "x" / "global_step_7")) == tmp_path / "x" / "global_step_7"
    step_dirs.commit(root, 5, {})
    assert step_dirs.resume_dir(root, "latest") == root / "global_step_5"
