"""A new driver resumes an SPMD run from its checkpoint directory (``demo --resume DIR``).

A run of 7 steps stops after 3 (``expertmesh demo --steps 3`` in a process of its own,
which ends, Ray and all), and ``expertmesh demo --resume DIR --steps 7`` (another process,
a fresh Ray cluster) trains the other 4. Its losses and final weights (the last
checkpoint: every master, dense weights and Adam state) equal an uninterrupted 7-step run
(``SpmdRuntime`` in this process, on a third Ray cluster) and the single-process
reference. Bad directories and incompatible settings are one line on stderr and exit 2.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from expertmesh.cli.main import build_parser, main
from expertmesh.runtime.checkpoint import CheckpointDir
from expertmesh.runtime.resume import load_resume
from expertmesh.runtime.spmd import SpmdRuntime
from expertmesh.workers.model import Corpus
from expertmesh.workers.reference import ReferenceLM

pytestmark = pytest.mark.integration

STEPS, STOP = 7, 3
FLAGS = [
    "--dcs", "2", "--ranks-per-dc", "2", "--masters", "2", "--spare", "2", "--experts", "8",
    "--layers", "2", "--hidden", "16", "--batch", "4", "--seq-len", "32", "--policy", "hybrid",
    "--trigger", "every_n:2", "--checkpoint-every", "2", "--inter-dc-gbps", "0.5",
    "--inter-dc-latency-ms", "2", "--no-serve", "--exit",
]  # fmt: skip


def _settings(ckdir: Path) -> Any:
    from expertmesh.cli.demo import build_settings

    args = build_parser().parse_args(["demo", *FLAGS, "--checkpoint-dir", str(ckdir)])
    return build_settings(args)


def _demo(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "expertmesh.cli", "demo", *FLAGS, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def _experts_only_bytes(tmp: Path, ck: Any) -> int:
    """The size of the same checkpoint without its resume part (what it was before)."""
    d = CheckpointDir(tmp / "experts-only-size")
    return d.write(ck.experts, step=ck.step, plan_version=0, run=ck.run).nbytes


def _final(ckdir: Path) -> Any:
    """The newest checkpoint in ``ckdir``, loaded."""
    return CheckpointDir(ckdir).load_latest()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("resume")
    ck = tmp / "run"
    first = _demo("--steps", str(STOP), "--checkpoint-dir", str(ck), "--json", str(tmp / "a.json"))
    assert first.returncode == 0, first.stderr[-2000:]
    stopped = tmp / "stopped"  # the directory as the stopped run left it (for bad-input tests)
    shutil.copytree(ck, stopped)
    second = _demo("--steps", str(STEPS), "--resume", str(ck), "--json", str(tmp / "b.json"))
    assert second.returncode == 0, second.stderr[-2000:]
    whole = tmp / "whole"
    with SpmdRuntime(_settings(whole)) as rt:
        steps = rt.train(STEPS)
        dense = [t.numpy() for t in ray.get(rt.workers[0].export_state.remote())["dense"]]
    out = {
        "tmp": tmp,
        "stopped": stopped,
        "a": json.loads((tmp / "a.json").read_text()),
        "b": json.loads((tmp / "b.json").read_text()),
        "resumed": _final(ck),
        "whole": _final(whole),
        "whole_steps": steps,
        "whole_dense": dense,
    }
    report = os.environ.get("EXPERTMESH_RESUME_REPORT")
    if report:  # the figures of docs/reliability.md
        b = out["b"]["summary"]
        Path(report).write_text(json.dumps({
            "resumed": b["resumed"], "checkpoints": b["checkpoints"],
            "checkpoint_write_ms_median": b["checkpoint_write_ms_median"],
            "experts_only_bytes": _experts_only_bytes(tmp, out["resumed"]),
        }, indent=1))  # fmt: skip
    yield out


@pytest.fixture(scope="module")
def reference(runs: dict[str, Any]) -> tuple[ReferenceLM, list[float]]:
    """The single-process reference trained the whole run: (model, losses)."""
    ref = ReferenceLM(_settings(runs["tmp"] / "x").lm)
    corpus = Corpus.load(None, 4_000_000)
    return ref, [ref.train_step(corpus, s, [0, 1, 2, 3]) for s in range(STEPS)]


def test_the_resumed_run_trains_the_remaining_steps_with_the_same_losses(
    runs: dict[str, Any], reference: tuple[ReferenceLM, list[float]]
) -> None:
    a, b = runs["a"]["steps"], runs["b"]["steps"]
    assert [s["step"] for s in a] == list(range(STOP))
    assert [s["step"] for s in b] == list(range(STOP, STEPS))  # the remaining ones, once
    assert runs["b"]["summary"]["resumed"]["step"] == STOP - 1
    whole = [s.loss for s in runs["whole_steps"]]
    np.testing.assert_allclose([s["loss"] for s in a + b], whole, rtol=1e-5)
    np.testing.assert_allclose([s["loss"] for s in a + b], reference[1], rtol=1e-5)


def test_the_resumed_run_ends_with_the_weights_of_an_uninterrupted_run(
    runs: dict[str, Any], reference: tuple[ReferenceLM, list[float]]
) -> None:
    got, whole = runs["resumed"], runs["whole"]
    assert got.step == whole.step == STEPS - 1
    ref = reference[0]
    assert set(got.experts) == set(whole.experts) == {(la, e) for la in range(2) for e in range(8)}
    for key, (w, m, v) in got.experts.items():
        ww, wm, wv = whole.experts[key]
        expect = [t.detach().numpy() for t in ref.expert(*key)]
        for a, b, c in zip(w, ww, expect, strict=True):
            np.testing.assert_allclose(a, b, atol=5e-6)
            np.testing.assert_allclose(a, c, atol=5e-6)
        for a, b in zip(m + v, wm + wv, strict=True):  # Adam state resumed, not restarted
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-9)
    arrays, n = got.arrays, got.extra["dense_tensors"]
    refd = [p.detach().numpy() for p in ref.dense.parameters()]
    for i in range(n):
        np.testing.assert_allclose(arrays[f"dense.w{i}"], whole.arrays[f"dense.w{i}"], atol=5e-6)
        np.testing.assert_allclose(arrays[f"dense.w{i}"], refd[i], atol=5e-6)
        np.testing.assert_allclose(runs["whole_dense"][i], refd[i], atol=5e-6)
    assert got.extra["opt_step"] == whole.extra["opt_step"] == STEPS


def _bad(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    rc = main(["demo", *FLAGS, "--steps", str(STEPS), *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_missing_corrupt_or_foreign_directory_is_one_line_and_exit_2(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    tmp = runs["tmp"]
    assert "no such directory" in _bad(capsys, "--resume", str(tmp / "nowhere"))
    foreign = tmp / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a checkpoint")
    assert "no checkpoint" in _bad(capsys, "--resume", str(foreign))
    corrupt = tmp / "corrupt"
    shutil.copytree(runs["stopped"], corrupt)
    for p in CheckpointDir(corrupt).paths():  # every checkpoint: nothing to fall back to
        data = p / "experts.npz"
        data.write_bytes(data.read_bytes()[:1000])
    assert "truncated" in _bad(capsys, "--resume", str(corrupt))
    old = tmp / "experts-only"  # what the rounds plane writes: experts, no resume state
    ck = load_resume(runs["stopped"], _settings(tmp / "y")).checkpoint
    CheckpointDir(old).write(ck.experts, step=ck.step, plan_version=0, run=ck.run)
    assert "no resume state" in _bad(capsys, "--resume", str(old))
    assert not (tmp / "nowhere").exists()  # nothing created on the way


def test_incompatible_settings_or_nothing_left_is_one_line_and_exit_2(
    runs: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    stopped = str(runs["stopped"])
    before = sorted(p.name for p in runs["stopped"].iterdir())
    err = _bad(capsys, "--resume", stopped, "--experts", "4")
    assert "lm.num_experts=8" in err and "4" in err
    assert "topology" in _bad(capsys, "--resume", stopped, "--ranks-per-dc", "4", "--experts", "8")
    assert "seed" in _bad(capsys, "--resume", stopped, "--seed", "1")
    assert "leaves none" in _bad(capsys, "--resume", stopped, "--steps", str(STOP))
    assert sorted(p.name for p in runs["stopped"].iterdir()) == before  # state unchanged
