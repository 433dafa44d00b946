"""ModelCheckpoint, resume, BackupAndRestore and OnRequestExit, with real processes killed."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import stepwatch
from stepwatch import (
    BackupAndRestore,
    CheckpointConfig,
    EarlyStopping,
    LambdaCallback,
    ModelCheckpoint,
    OnRequestExit,
    load_checkpoint,
    save_checkpoint,
)

from .conftest import make_batches, make_model, wait_until
from .jobs import train_job

ROOT = Path(__file__).resolve().parents[1]


def _job(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.jobs.train_job", *args]


def _run_job(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _job(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def _weights(model: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.train_network.parameters()]


def _straight_run() -> tuple[list[torch.Tensor], list[dict[str, Any]], float]:
    model, train, valid = train_job.build()
    steering = train_job.steering()
    model.fit(train_job.EPOCHS, train, valid, callbacks=steering)
    lr = model.optimizer.param_groups[0]["lr"]
    return _weights(model), [cb.state_dict() for cb in steering], lr


@pytest.fixture(scope="module")
def straight() -> tuple[list[torch.Tensor], list[dict[str, Any]], float]:
    return _straight_run()


def _resume(path: Path) -> tuple[list[torch.Tensor], list[dict[str, Any]], float]:
    model, train, valid = train_job.build()
    torch.manual_seed(12345)  # the checkpoint's generators must win over this
    steering = train_job.steering()
    steps: list[int] = []
    seen = LambdaCallback(
        on_train_step_end=lambda rc: steps.append(rc.original_args().cur_step_num)
    )
    # The resumed run leaves ModelCheckpoint out: its saved state is reported, not lost silently.
    with pytest.warns(UserWarning, match=r"state for callbacks that are not in this run.*Model"):
        model.fit(train_job.EPOCHS, train, valid, callbacks=[*steering, seen], resume_from=path)
    # Global steps continue from the checkpoint's to the end of the run.
    saved = load_checkpoint(path)["step"]
    assert steps == list(range(saved + 1, train_job.EPOCHS * 8 + 1))
    return (
        _weights(model),
        [cb.state_dict() for cb in steering],
        model.optimizer.param_groups[0]["lr"],
    )


def _assert_same_run(a: Any, b: Any) -> None:
    for x, y in zip(a[0], b[0]):
        torch.testing.assert_close(x, y)
    assert a[1] == b[1]
    assert a[2] == b[2]


@pytest.mark.parametrize(
    ("mode", "arg", "checkpoint"),
    [("kill-after-epoch", "3", "CKP-3_8.pt"), ("kill-after-step", "29", "CKP-4_3.pt")],
)
def test_resume_after_sigkill_equals_straight_run(
    tmp_path: Path, straight: Any, mode: str, arg: str, checkpoint: str
) -> None:
    result = _run_job(mode, str(tmp_path), arg)
    assert result.returncode == -signal.SIGKILL, result.stderr
    resumed = _resume(tmp_path / checkpoint)
    _assert_same_run(resumed, straight)
    # The run exercised the steering state: the LR was reduced and patience counted.
    assert straight[2] < 0.02
    assert straight[1][0]["best_epoch"] > 0


def test_sigkill_during_saves_leaves_newest_checkpoint_loadable(tmp_path: Path) -> None:
    rng = random.Random(7)
    for attempt in range(3):
        directory = tmp_path / f"try{attempt}"
        proc = subprocess.Popen(
            _job("save-forever", str(directory)),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            wait_until(lambda d=directory: any(d.glob("CKP-*_*.pt")), timeout=60)
            time.sleep(rng.uniform(0.05, 0.6))
        finally:
            proc.kill()
            _, err = proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL, err.decode()
        files = [p for p in directory.glob("CKP-*.pt")]
        newest = max((p for p in files if "last" not in p.name), key=lambda p: p.stat().st_mtime)
        state = load_checkpoint(newest)
        assert state["network"]["0.weight"].shape == (1024, 8)
        load_checkpoint(directory / "CKP-last.pt")
        # keep_checkpoint_max=3; a kill between writing a new file and pruning the oldest
        # leaves one more.
        assert len([p for p in files if "last" not in p.name]) <= 3 + 1


def test_sigterm_with_on_request_exit_exits_zero_with_resumable_checkpoint(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        _job("wait-for-sigterm", str(tmp_path)),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, err
    assert "clean exit" in out
    state = load_checkpoint(tmp_path / "exit.pt")
    assert state["step"] >= 2
    model, train, valid = train_job.build()
    model.fit(state["epoch"] + 1, train, valid, resume_from=tmp_path / "exit.pt")


def test_backup_and_restore_continues_after_a_crash(tmp_path: Path, straight: Any) -> None:
    crashed = _run_job("crash-at-epoch", str(tmp_path), "4")
    assert crashed.returncode != 0 and "simulated crash at epoch 4" in crashed.stderr
    assert load_checkpoint(tmp_path / "backup.pt")["epoch"] == 4
    model, train, valid = train_job.build()
    steering = train_job.steering()
    model.fit(train_job.EPOCHS, train, valid, callbacks=[*steering, BackupAndRestore(tmp_path)])
    resumed = (
        _weights(model),
        [cb.state_dict() for cb in steering],
        model.optimizer.param_groups[0]["lr"],
    )
    _assert_same_run(resumed, straight)
    assert not (tmp_path / "backup.pt").exists()


def _sigterm_at(step: int) -> LambdaCallback:
    def send(rc: Any) -> None:
        if rc.original_args().cur_step_num == step:
            os.kill(os.getpid(), signal.SIGTERM)

    return LambdaCallback(on_train_step_end=send)


def test_interrupted_run_keeps_its_backup_and_resumes(tmp_path: Path) -> None:
    callbacks = [
        _sigterm_at(6),
        OnRequestExit(directory=tmp_path, file_name="exit"),
        BackupAndRestore(tmp_path / "bk", save_freq=2),
    ]
    make_model().train(3, make_batches(4), callbacks=callbacks)
    backup = load_checkpoint(tmp_path / "bk" / "backup.pt")
    assert backup["step"] == 6  # kept: the run was interrupted, not finished
    exit_state = load_checkpoint(tmp_path / "exit.pt")
    assert (exit_state["step"], exit_state["epoch_complete"]) == (6, False)
    steps: list[int] = []
    seen = LambdaCallback(
        on_train_step_end=lambda rc: steps.append(rc.original_args().cur_step_num)
    )
    make_model().train(3, make_batches(4), callbacks=[seen, BackupAndRestore(tmp_path / "bk")])
    assert steps == list(range(7, 13))
    assert not (tmp_path / "bk" / "backup.pt").exists()


def test_on_request_exit_on_an_epochs_last_step_saves_at_epoch_end(tmp_path: Path) -> None:
    exit_cb = OnRequestExit(directory=tmp_path, file_name="exit")
    make_model().train(3, make_batches(4), callbacks=[_sigterm_at(4), exit_cb])
    state = load_checkpoint(tmp_path / "exit.pt")
    assert (state["epoch"], state["step"], state["epoch_complete"]) == (1, 4, True)
    make_model().train(3, make_batches(4), resume_from=tmp_path / "exit.pt")
    # Used again, the same callback writes a new checkpoint.
    (tmp_path / "exit.pt").unlink()
    make_model().train(2, make_batches(4), callbacks=[_sigterm_at(2), exit_cb])
    assert load_checkpoint(tmp_path / "exit.pt")["step"] == 2


def test_stop_mid_epoch_saves_an_incomplete_epoch(tmp_path: Path) -> None:
    def stop_at_3(rc: Any) -> None:
        if rc.original_args().cur_step_num == 3:
            rc.request_stop("test")

    config = CheckpointConfig(save_checkpoint_steps=100)
    cbs = [
        LambdaCallback(on_train_step_end=stop_at_3),
        ModelCheckpoint(directory=tmp_path, config=config),
    ]
    make_model().train(2, make_batches(5), callbacks=cbs)
    state = load_checkpoint(tmp_path / "CKP-1_3.pt")
    assert (state["step_in_epoch"], state["epoch_complete"]) == (3, False)


def test_backup_and_restore_without_a_backup_does_not_crash(tmp_path: Path) -> None:
    make_model().train(1, make_batches(2), callbacks=[BackupAndRestore(tmp_path, save_freq=1000)])
    assert not (tmp_path / "backup.pt").exists()


def test_backup_and_restore_step_frequency_saves_mid_epoch(tmp_path: Path) -> None:
    steps: list[int] = []

    def stop_after_5(rc: Any) -> None:
        if rc.original_args().cur_step_num == 5:
            steps.append(load_checkpoint(tmp_path / "backup.pt")["step"])

    cbs = [
        BackupAndRestore(tmp_path, save_freq=2, delete_checkpoint=False),
        LambdaCallback(on_train_step_end=stop_after_5),
    ]
    make_model().train(2, make_batches(4), callbacks=cbs)
    assert steps == [4]


# -- ModelCheckpoint -----------------------------------------------------------------------
def test_file_names_keep_max_prefix_collision_and_last(tmp_path: Path) -> None:
    config = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=2)
    make_model().train(2, make_batches(3), callbacks=[ModelCheckpoint("net", tmp_path, config)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["net-2_1.pt", "net-2_3.pt", "net-last.pt"]
    assert os.path.samefile(tmp_path / "net-last.pt", tmp_path / "net-2_3.pt")
    ckpt = ModelCheckpoint("net", tmp_path, config)
    make_model().train(1, make_batches(2), callbacks=[ckpt])
    assert ckpt.prefix == "net_1" and (tmp_path / "net_1-1_2.pt").exists()
    assert ckpt.latest_ckpt_file_name == str(tmp_path / "net_1-1_2.pt")


def test_seconds_policy_saves_mid_run(tmp_path: Path) -> None:
    config = CheckpointConfig(
        save_checkpoint_steps=0, save_checkpoint_seconds=1, keep_checkpoint_max=50
    )
    slow = LambdaCallback(on_train_step_end=lambda rc: time.sleep(0.3))
    make_model().train(
        2, make_batches(5), callbacks=[slow, ModelCheckpoint(directory=tmp_path, config=config)]
    )
    saved = sorted(p.name for p in tmp_path.glob("CKP-?_*.pt"))
    # 3 s of training with a 1 s policy: saves along the way, plus the one at the end.
    assert len(saved) >= 3 and "CKP-2_5.pt" in saved


def test_checkpoint_contents_and_append_info(tmp_path: Path) -> None:
    config = CheckpointConfig(
        save_checkpoint_steps=4, append_info=["epoch_num", "step_num", {"lr": 0.1, "tag": "x"}]
    )
    model = make_model()
    es = EarlyStopping("loss", patience=5)
    model.train(
        1, make_batches(4), callbacks=[es, ModelCheckpoint(directory=tmp_path, config=config)]
    )
    state = load_checkpoint(tmp_path / "CKP-1_4.pt")
    assert state["append_info"] == {"epoch_num": 1, "step_num": 4, "lr": 0.1, "tag": "x"}
    assert (state["epoch"], state["step"], state["epoch_complete"]) == (1, 4, True)
    assert set(state["callbacks"]) == {es.state_key, ModelCheckpoint(directory=tmp_path).state_key}
    for key, value in model.train_network.state_dict().items():
        assert state["network"][key].equal(value)


def test_save_best_only_keeps_best_by_monitor(tmp_path: Path) -> None:
    config = CheckpointConfig(save_best_only=True, monitor="loss", keep_checkpoint_max=10)
    ckpt = ModelCheckpoint(directory=tmp_path, config=config)
    from .test_steering import Inject

    make_model().train(5, make_batches(1), callbacks=[Inject("loss", [3, 1, 2, 0.5, 0.7]), ckpt])
    assert sorted(p.name for p in tmp_path.glob("CKP-?_*.pt")) == [
        "CKP-1_1.pt",
        "CKP-2_1.pt",
        "CKP-4_1.pt",
    ]
    assert ckpt.best_ckpt_file_name == str(tmp_path / "CKP-4_1.pt") and ckpt.best == 0.5


def test_async_save_writes_the_same_checkpoint(tmp_path: Path) -> None:
    for sub, async_save in (("sync", False), ("async", True)):
        config = CheckpointConfig(
            save_checkpoint_steps=1, keep_checkpoint_max=100, async_save=async_save
        )
        make_model().train(
            2, make_batches(3), callbacks=[ModelCheckpoint(directory=tmp_path / sub, config=config)]
        )
    names = sorted(p.name for p in (tmp_path / "sync").glob("CKP-*_*.pt"))
    assert names == sorted(p.name for p in (tmp_path / "async").glob("CKP-*_*.pt"))
    for name in names:
        a = load_checkpoint(tmp_path / "sync" / name)["network"]
        b = load_checkpoint(tmp_path / "async" / name)["network"]
        assert all(a[k].equal(b[k]) for k in a)


def test_exception_save_writes_breakpoint(tmp_path: Path) -> None:
    def boom(rc: Any) -> None:
        if rc.original_args().cur_step_num == 3:
            raise RuntimeError("boom")

    config = CheckpointConfig(save_checkpoint_steps=100, exception_save=True)
    with pytest.raises(RuntimeError, match="boom"):
        make_model().train(
            2,
            make_batches(2),
            callbacks=[
                ModelCheckpoint(directory=tmp_path, config=config),
                LambdaCallback(on_train_step_end=boom),
            ],
        )
    # The failure is in step 3's step-end hook: step 3's update is done and counted.
    assert load_checkpoint(tmp_path / "CKP-2_1_breakpoint.pt")["step"] == 3


def test_breakpoint_does_not_count_a_step_that_failed_half_way(tmp_path: Path) -> None:
    calls = {"n": 0}

    def loss_fn(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("forward failed")
        return nn.functional.cross_entropy(out, label)

    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    model = stepwatch.Model(net, loss_fn, torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    config = CheckpointConfig(save_checkpoint_steps=100, exception_save=True)
    with pytest.raises(RuntimeError, match="forward failed"):
        model.train(
            2, make_batches(2), callbacks=[ModelCheckpoint(directory=tmp_path, config=config)]
        )
    state = load_checkpoint(tmp_path / "CKP-1_2_breakpoint.pt")
    assert (state["epoch"], state["step"]) == (1, 2)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        (
            {"save_checkpoint_steps": 0, "keep_checkpoint_max": 0},
            ValueError,
            "can't be all None or 0",
        ),
        ({"save_checkpoint_steps": -1}, ValueError, "'save_checkpoint_steps' must be an int >= 0"),
        ({"keep_checkpoint_max": "5"}, TypeError, "'keep_checkpoint_max' must be an int"),
        ({"async_save": 1}, TypeError, "'async_save' must be a bool"),
        ({"append_info": "epoch_num"}, TypeError, "'append_info' must be a list"),
        ({"append_info": ["epochs"]}, ValueError, "'epoch_num' or 'step_num'"),
        ({"append_info": [{"a": [1]}]}, TypeError, "map str to int, float or str"),
        ({"append_info": [{}, {}]}, ValueError, "at most one dict"),
        ({"saved_network": "net"}, TypeError, "'saved_network' must be a torch.nn.Module"),
        ({"exception_save": "yes"}, TypeError, "'exception_save' must be a bool"),
    ],
)
def test_checkpoint_config_args_validation(kwargs: dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        CheckpointConfig(**kwargs)


def test_checkpoint_config_policies() -> None:
    config = CheckpointConfig(save_checkpoint_steps=10, save_checkpoint_seconds=30)
    assert config.save_checkpoint_seconds is None  # MindSpore's value: the step policy rules
    config = CheckpointConfig(
        save_checkpoint_steps=0, keep_checkpoint_max=0, keep_checkpoint_per_n_minutes=2
    )
    assert config.keep_checkpoint_max == 0 and config.keep_checkpoint_per_n_minutes == 2


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"prefix": "a/b"}, ValueError, "without '/'"),
        ({"prefix": 3}, TypeError, "'prefix' must be a str"),
        (
            {"config": {"save_checkpoint_steps": 1}},
            TypeError,
            "'config' must be a CheckpointConfig",
        ),
        ({"directory": 5}, TypeError, "'directory' must be a str"),
    ],
)
def test_model_checkpoint_args_validation(kwargs: dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        ModelCheckpoint(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"backup_dir": 3}, TypeError, "'backup_dir' must be"),
        ({"backup_dir": "b", "save_freq": "step"}, ValueError, "'save_freq' must be 'epoch'"),
        ({"backup_dir": "b", "save_freq": 0}, ValueError, "'save_freq' must be an int >= 1"),
        (
            {"backup_dir": "b", "delete_checkpoint": 0},
            TypeError,
            "'delete_checkpoint' must be a bool",
        ),
    ],
)
def test_backup_and_restore_args_validation(kwargs: dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        BackupAndRestore(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"save_ckpt": 1}, TypeError, "'save_ckpt' must be a bool"),
        ({"file_name": "a/b"}, ValueError, "'file_name' must be a file name"),
        ({"directory": 1}, TypeError, "'directory' must be a str"),
        ({"sig": 99999}, ValueError, "'sig' must be signal numbers"),
        ({"sig": []}, ValueError, "at least one signal"),
    ],
)
def test_on_request_exit_args_validation(kwargs: dict[str, Any], exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        OnRequestExit(**kwargs)


def test_on_request_exit_keeps_its_handler_between_runs(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    exit_cb = OnRequestExit(directory=tmp_path)
    try:
        make_model().train(1, make_batches(2), callbacks=[exit_cb])
        # As in MindSpore, the handler stays: a SIGTERM between runs is noted, not fatal.
        assert signal.getsignal(signal.SIGTERM) == exit_cb._handle
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(lambda: exit_cb.received == signal.SIGTERM)
        # Outside a run, Ctrl-C still interrupts at once.
        with pytest.raises(KeyboardInterrupt):
            signal.getsignal(signal.SIGINT)(signal.SIGINT, None)  # type: ignore[operator]
    finally:
        exit_cb.restore_handlers()
    assert signal.getsignal(signal.SIGTERM) is before


def test_on_request_exit_stops_model_eval_and_saves_the_evaluated_weights(
    tmp_path: Path,
) -> None:
    model = make_model(metrics={"accuracy"})
    model.train(1, make_batches(2))
    exit_cb = OnRequestExit(directory=tmp_path, file_name="net")
    seen: list[int] = []

    def send(rc: Any) -> None:
        seen.append(rc.original_args().cur_step_num)
        if rc.original_args().cur_step_num == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        model.eval(make_batches(6), callbacks=[LambdaCallback(on_eval_step_end=send), exit_cb])
    finally:
        exit_cb.restore_handlers()
    assert seen == [1, 2]  # the pass ended after the step the signal came in
    assert exit_cb.checkpoint_path == tmp_path / "net_eval.pt"
    net = make_model().train_network
    stepwatch.load_checkpoint(tmp_path / "net_eval.pt", net)
    for a, b in zip(net.parameters(), model.train_network.parameters()):
        torch.testing.assert_close(a, b)
    # Without a signal, the next eval runs whole.
    seen.clear()
    model.eval(make_batches(3), callbacks=[LambdaCallback(on_eval_step_end=seen.append)])
    assert len(seen) == 3


# -- load / save ---------------------------------------------------------------------------
def test_save_and_load_checkpoint_of_model_and_module(tmp_path: Path) -> None:
    trained = make_model()
    trained.train(2, make_batches(2))
    path = save_checkpoint(trained, tmp_path / "m.pt")
    fresh = make_model(seed=5)
    load_checkpoint(path, fresh)
    for a, b in zip(trained.train_network.parameters(), fresh.train_network.parameters()):
        assert a.equal(b)
    net = nn.Linear(2, 2)
    save_checkpoint(net, tmp_path / "net.pt")
    other = nn.Linear(2, 2)
    load_checkpoint(tmp_path / "net.pt", other)
    assert other.weight.equal(net.weight)
    with pytest.raises(ValueError, match="holds weights only"):
        make_model().train(3, make_batches(1), resume_from=path)
    with pytest.raises(TypeError, match="'save_obj' must be a Model"):
        save_checkpoint(3, tmp_path / "x.pt")


def test_load_checkpoint_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="checkpoint file not found"):
        load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable stepwatch checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")
    torch.save({"a": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a stepwatch checkpoint"):
        load_checkpoint(tmp_path / "other.pt")
    with pytest.raises(TypeError, match="'resume_from' must be a checkpoint path"):
        make_model().train(1, make_batches(1), resume_from=3)  # type: ignore[arg-type]


def test_resume_past_the_end_is_value_error(tmp_path: Path) -> None:
    make_model().train(2, make_batches(1), callbacks=[ModelCheckpoint(directory=tmp_path)])
    with pytest.raises(ValueError, match="is at epoch 2; 'epoch' must be larger"):
        make_model().train(2, make_batches(1), resume_from=tmp_path / "CKP-last.pt")
    assert stepwatch.load_checkpoint(tmp_path / "CKP-last.pt")["epoch"] == 2


def test_checkpoint_files_get_the_mode_the_umask_gives(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = stepwatch.save_checkpoint(nn.Linear(2, 1), tmp_path / "w.pt")
        assert path.stat().st_mode & 0o777 == 0o644
        os.umask(0o077)
        path = stepwatch.save_checkpoint(nn.Linear(2, 1), tmp_path / "private.pt")
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_a_failed_checkpoint_write_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match=r"cannot write checkpoint '.*w\.pt' \(\d+ KiB free"):
        stepwatch.save_checkpoint(nn.Linear(2, 1), tmp_path / "w.pt")
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


def test_a_resume_naming_the_folder_relatively_continues_the_same_series(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=10)
    first = ModelCheckpoint("net", tmp_path / "ck", config)  # absolute
    make_model().train(1, make_batches(4), callbacks=[first])
    again = ModelCheckpoint("net", "ck", config)  # the same folder, named relatively
    make_model().train(
        2, make_batches(4), callbacks=[again], resume_from=tmp_path / "ck" / "net-last.pt"
    )
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert again.prefix == "net" and not any(n.startswith("net_1") for n in names)
    assert "net-2_4.pt" in names


def test_a_killed_snapshot_write_is_cleaned_up_at_the_next_start(tmp_path: Path) -> None:
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    stale = snaps / ".tmp-anomaly-spike-step40.ptxyz"
    stale.write_bytes(b"x" * 1000)
    monitor = stepwatch.AnomalyMonitor(detectors=["nonfinite"], snapshot_dir=snaps)
    make_model().train(1, make_batches(2), callbacks=[monitor])
    assert not stale.exists()


def test_flipped_bytes_in_a_checkpoints_weights_are_found_on_load(tmp_path: Path) -> None:
    import struct

    net = nn.Linear(64, 64)
    path = stepwatch.save_checkpoint(net, tmp_path / "w.pt")
    stepwatch.load_checkpoint(path, nn.Linear(64, 64))  # intact: loads
    data = bytearray(path.read_bytes())
    needle = struct.pack("<f", float(net.weight.detach()[3, 5]))
    at = data.find(needle)
    assert at > 0
    data[at : at + 4] = struct.pack("<f", 9.75)  # one weight changed on disk
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="is damaged: its contents do not match the checksum"):
        stepwatch.load_checkpoint(path, nn.Linear(64, 64))


class _SignalOnFirstLook(list):  # type: ignore[type-arg]
    """Batches whose first look (Model.eval's checks, before any callback begins) brings a
    SIGTERM, as a signal sent just after eval() was called does."""

    sent = False

    def __getitem__(self, index: Any) -> Any:
        if not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return super().__getitem__(index)


def test_a_signal_that_comes_before_the_eval_pass_begins_stops_it(tmp_path: Path) -> None:
    model = make_model(metrics={"accuracy"})
    trained = OnRequestExit(directory=tmp_path, file_name="train")
    evaluated = OnRequestExit(directory=tmp_path, file_name="net")
    seen: list[int] = []
    record = LambdaCallback(on_eval_step_end=lambda rc: seen.append(rc.cb_params.cur_step_num))
    try:
        model.train(1, make_batches(2), callbacks=[trained])  # its handler stays installed
        # The signal comes while eval() checks its data: the training's handler takes it,
        # and the pass that begins next acts on it (MindSpore's test: SIGTERM 0.14 s in).
        model.eval(_SignalOnFirstLook(make_batches(40)), callbacks=[record, evaluated])
        assert seen == [1] and evaluated.checkpoint_path == tmp_path / "net_eval.pt"
        assert trained.received is None  # handed over, not acted on twice
        # Between runs, to the same callback: the next run stops after its first step.
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(lambda: evaluated.received == signal.SIGTERM)
        seen.clear()
        model.eval(make_batches(40), callbacks=[record, evaluated])
        assert seen == [1]
        # A signal that stopped a run is not carried into the next one.
        seen.clear()
        model.eval(make_batches(40), callbacks=[record, evaluated])
        assert len(seen) == 40
    finally:
        evaluated.restore_handlers()
        trained.restore_handlers()
