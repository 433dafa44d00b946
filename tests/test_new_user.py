"""What a new user trips over: each test reproduces one finding and pins its fix."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stepwatch import (
    BackupAndRestore,
    Callback,
    CheckpointConfig,
    LambdaCallback,
    Metric,
    Model,
    ModelCheckpoint,
    OnRequestExit,
    RunContext,
    TimeMonitor,
)

from .conftest import make_batches, make_model


# -- 1. a second resume continues the checkpoint series --------------------------------------
def _steps_seen() -> tuple[list[int], LambdaCallback]:
    steps: list[int] = []
    return steps, LambdaCallback(
        on_train_step_end=lambda rc: steps.append(rc.cb_params.cur_step_num)
    )


def test_resuming_twice_from_last_continues_the_series(tmp_path: Path) -> None:
    def checkpoint() -> ModelCheckpoint:
        config = CheckpointConfig(save_checkpoint_steps=4, keep_checkpoint_max=2)
        return ModelCheckpoint(prefix="net", directory=tmp_path, config=config)

    data = make_batches(4)
    make_model().train(3, data, callbacks=[checkpoint()])
    make_model().train(6, data, callbacks=[checkpoint()], resume_from=tmp_path / "net-last.pt")
    steps, seen = _steps_seen()
    make_model().train(
        7, data, callbacks=[checkpoint(), seen], resume_from=tmp_path / "net-last.pt"
    )
    assert steps == [25, 26, 27, 28]  # epoch 7 only: the second resume did not go backwards
    files = sorted(p.name for p in tmp_path.glob("*.pt"))
    assert files == ["net-6_4.pt", "net-7_4.pt", "net-last.pt"]


# -- 5. custom metrics -----------------------------------------------------------------------
class _CountAbove(Metric):
    """A custom metric whose clear() uses an attribute set after super().__init__()."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold

    def clear(self) -> None:
        self.hits = 0 * self.threshold

    def update(self, *inputs: Any) -> None:
        y_pred, _ = inputs
        self.hits += int((y_pred.max(dim=1).values > self.threshold).sum())

    def eval(self) -> float:
        return float(self.hits)


def test_custom_metric_may_set_attributes_after_super_init() -> None:
    model = make_model(metrics={"above": _CountAbove(0.0)})
    result = model.eval(make_batches(2))
    assert result["above"] >= 0


def test_a_failing_metric_is_named() -> None:
    class Broken(_CountAbove):
        def eval(self) -> float:
            raise ZeroDivisionError("no samples")

    model = make_model(metrics={"broken": Broken(0.0)})
    with pytest.raises(ZeroDivisionError) as info:
        model.eval(make_batches(2))
    assert "(raised in metric 'broken', Broken.eval)" in info.value.__notes__


def test_builtin_metrics_declare_their_direction() -> None:
    from stepwatch.train import metrics

    assert metrics.Accuracy.direction == "max" and metrics.MAE.direction == "min"
    assert metrics.Loss.direction == "min" and metrics.Precision.direction == "max"


# -- 12. MindSpore parity --------------------------------------------------------------------
def test_eval_end_sees_metric_values_and_fields_exist_before_step_one() -> None:
    seen: dict[str, Any] = {}

    class Spy(Callback):
        def on_train_begin(self, run_context: RunContext) -> None:
            seen["element_at_begin"] = run_context.cb_params.train_dataset_element

        def on_eval_end(self, run_context: RunContext) -> None:
            p = run_context.cb_params
            seen.setdefault("metrics", []).append(dict(p.metrics))
            seen.setdefault("sink", []).append(p.dataset_sink_mode)

        def on_train_epoch_end(self, run_context: RunContext) -> None:
            seen["metrics_after"] = run_context.cb_params.metrics

    model = make_model(metrics={"accuracy"})
    model.fit(1, make_batches(2), make_batches(2), callbacks=[Spy()])
    model.eval(make_batches(2), callbacks=[Spy()])
    assert seen["element_at_begin"] is None
    assert all(isinstance(m["accuracy"], float) for m in seen["metrics"])
    assert seen["sink"] == [False, False]
    assert isinstance(seen["metrics_after"]["accuracy"], float)  # the values, to the epoch end


def test_time_monitor_prints_data_time_on_the_eval_line(capsys: pytest.CaptureFixture[str]) -> None:
    model = make_model(metrics={"accuracy"})
    model.fit(1, make_batches(2), make_batches(2), callbacks=[TimeMonitor(data_time=True)])
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("Eval epoch time") and "data time" in line for line in lines)
    assert any(line.startswith("Train epoch time") and "data time" in line for line in lines)


@pytest.mark.parametrize("sig", [9, 19])
def test_on_request_exit_rejects_uncatchable_signals(sig: int) -> None:
    with pytest.raises(ValueError, match="cannot be caught"):
        OnRequestExit(sig=sig)


def test_on_request_exit_and_backup_argument_types() -> None:
    with pytest.raises(TypeError, match="'file_name' must be a str"):
        OnRequestExit(file_name=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'backup_dir' must name a folder"):
        BackupAndRestore("")


def test_backup_with_nothing_left_to_train_is_deleted(tmp_path: Path) -> None:
    data = make_batches(2)
    make_model().train(2, data, callbacks=[BackupAndRestore(tmp_path, delete_checkpoint=False)])
    assert (tmp_path / "backup.pt").is_file()
    make_model().train(2, data, callbacks=[BackupAndRestore(tmp_path)])
    assert list(tmp_path.iterdir()) == []


def test_network_returning_its_own_loss_still_trains() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(self.fc(x), y)

    net = Net()
    model = Model(net, None, torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    losses: list[float] = []
    model.train(
        2,
        make_batches(2),
        callbacks=[LambdaCallback(on_train_epoch_end=lambda rc: losses.append(rc.cb_params.loss))],
    )
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)


def test_a_model_without_loss_fn_or_with_dict_batches_is_refused_before_training() -> None:
    class Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": torch.ones(4), "y": torch.tensor(i % 3)}

    loader = torch.utils.data.DataLoader(Rows(), batch_size=8)
    with pytest.raises(ValueError, match=r"must be \(data, label\) .* a dict with keys 'x', 'y'"):
        make_model().train(1, loader)  # a Hugging Face style loader with a loss function
    net = nn.Sequential(nn.Linear(4, 3))
    no_loss = Model(net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), device="cpu")
    with pytest.raises(ValueError, match=r"no loss_fn, so each batch \(2 columns\) goes to the "
                       r"network.*Sequential\.forward cannot take it"):  # fmt: skip
        no_loss.train(1, make_batches(2))
    with pytest.raises(ValueError, match=r"must return the loss \(one value\), but it returned "
                       r"a tensor of shape \(8, 3\)"):  # fmt: skip
        no_loss.train(1, [(torch.ones(8, 4),)])  # the network's outputs are no loss


# -- 3. labels that do not fit the outputs ---------------------------------------------------
def _regression_model(**kwargs: Any) -> Model:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 1))
    kwargs.setdefault("device", "cpu")
    return Model(net, nn.MSELoss(), torch.optim.SGD(net.parameters(), lr=0.01), **kwargs)


def test_regression_labels_of_the_wrong_shape_are_refused_before_training() -> None:
    x = torch.randn(32, 4)
    batches = [(x, x[:, 0])]  # labels (32,) vs outputs (32, 1)
    steps, seen = _steps_seen()
    with pytest.raises(ValueError, match=r"labels \(32,\) vs outputs \(32, 1\).*reshape"):
        _regression_model().train(1, batches, callbacks=[seen])
    assert steps == []
    _regression_model().train(1, [(x, x[:, :1])])  # the right shape trains


@pytest.mark.parametrize(
    ("label", "match"),
    [
        (torch.zeros(8, 1, dtype=torch.long), r"labels \(8, 1\) vs outputs \(8, 3\).*squeeze"),
        (torch.zeros(8), r"are torch.float32.*labels.long\(\)"),
        (torch.full((8,), 3), r"label 3 is out of range for outputs \(8, 3\) with 3 classes"),
        (torch.full((8,), -2), r"label -2 is out of range"),
    ],
)
def test_class_labels_that_cross_entropy_cannot_take(label: torch.Tensor, match: str) -> None:
    x = torch.randn(8, 4)
    with pytest.raises(ValueError, match=match):
        make_model().train(1, [(x, label)])


def test_a_regression_metric_on_a_classifier_is_named() -> None:
    with pytest.raises(ValueError, match=r"metric 'mae' \(MAE\) cannot use outputs \(8, 3\)"):
        make_model(metrics={"mae"}).fit(1, make_batches(2), make_batches(1))


def _loader_of(batches: list[Any]) -> torch.utils.data.DataLoader[Any]:
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True
    )


def test_shape_check_covers_dataloaders_and_leaves_the_rng_alone() -> None:
    x = torch.randn(32, 4)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x[:, 0]), batch_size=8, shuffle=True
    )
    with pytest.raises(ValueError, match=r"labels \(8,\) vs outputs \(8, 1\)"):
        _regression_model().train(1, loader)
    from stepwatch.train.checks import check_first_forward

    network = make_model().train_network
    torch.manual_seed(3)
    before = torch.rand(1)
    torch.manual_seed(3)
    check_first_forward(network, nn.CrossEntropyLoss(), {}, _loader_of(make_batches(2)), "cpu")
    # The check drew nothing from the generators (the loader would have, had it iterated).
    assert torch.equal(torch.rand(1), before)


# -- 4. resume with another optimizer, a corrupt file, another batch size --------------------
def test_resume_with_another_optimizer_is_refused_before_any_callback(tmp_path: Path) -> None:
    make_model().train(1, make_batches(2), callbacks=[ModelCheckpoint(directory=tmp_path)])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
    before = [p.detach().clone() for p in net.parameters()]
    model = Model(net, nn.CrossEntropyLoss(), torch.optim.Adam(net.parameters()), device="cpu")
    began: list[int] = []
    spy = LambdaCallback(on_train_begin=lambda rc: began.append(1))
    with pytest.raises(ValueError, match=r"another kind of optimizer than this Model's Adam"):
        model.train(3, make_batches(2), callbacks=[spy], resume_from=tmp_path / "CKP-last.pt")
    assert began == []
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_a_corrupt_checkpoint_does_not_advise_an_unsafe_load(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="not a readable stepwatch checkpoint") as info:
        make_model().train(2, make_batches(2), resume_from=bad)
    assert "weights_only" not in str(info.value) and info.value.__cause__ is None


@pytest.mark.filterwarnings("ignore:.*not in this run")
def test_mid_epoch_resume_with_another_batch_size_is_refused(tmp_path: Path) -> None:
    config = CheckpointConfig(save_checkpoint_steps=3, keep_checkpoint_max=5)
    make_model().train(
        1, make_batches(4), callbacks=[ModelCheckpoint(directory=tmp_path, config=config)]
    )
    with pytest.raises(ValueError, match=r"middle of epoch 1 \(step 3 of 4\).*8 steps per epoch"):
        make_model().train(2, make_batches(8), resume_from=tmp_path / "CKP-1_3.pt")
    # From an epoch's end another batch size is fine: steps are renumbered on the new epochs.
    steps, seen = _steps_seen()
    make_model().train(2, make_batches(8), callbacks=[seen], resume_from=tmp_path / "CKP-1_4.pt")
    assert steps == list(range(9, 17))


# -- 6. errors at the door -------------------------------------------------------------------
def test_checkpoint_directory_that_is_a_file_is_refused_at_construction(tmp_path: Path) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="'directory' must be a folder"):
        ModelCheckpoint(directory=a_file)
    with pytest.raises(ValueError, match="'directory' must be a folder"):
        ModelCheckpoint(directory=a_file / "sub")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'device' is 'cuda', but this PyTorch sees no CUDA"):
        make_model(device="cuda")


def test_save_checkpoint_names_the_target_not_the_temporary(tmp_path: Path) -> None:
    from stepwatch import save_checkpoint

    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError) as info:
        save_checkpoint(make_model(), tmp_path / "file" / "net.pt")
    assert ".tmp-" not in str(info.value) and "net.pt" in str(info.value)


# -- 7. silent no-ops ------------------------------------------------------------------------
def test_an_optimizer_over_another_network_is_refused() -> None:
    net, other = nn.Linear(4, 3), nn.Linear(4, 3)
    with pytest.raises(ValueError, match="updates none of the network's parameters"):
        Model(net, nn.CrossEntropyLoss(), torch.optim.SGD(other.parameters(), lr=0.1))


def test_a_valid_frequency_list_outside_the_run_warns() -> None:
    model = make_model(metrics={"accuracy"})
    with pytest.warns(UserWarning, match=r"'valid_frequency' \[5\] names no epoch"):
        model.fit(2, make_batches(1), make_batches(1), valid_frequency=[5])


# -- 9. Keras habits -------------------------------------------------------------------------
def test_train_and_fit_return_the_history() -> None:
    model = make_model(metrics={"accuracy"})
    history = model.fit(2, make_batches(2), make_batches(1))
    assert history.epoch == {"epoch": [1, 2]} and len(history.history["eval_accuracy"]) == 2
    from stepwatch import History

    mine = History()
    assert model.train(1, make_batches(1), callbacks=[mine]) is mine


def test_predict_takes_a_dataset_and_concatenates() -> None:
    model = make_model()
    batches = make_batches(3)
    out = model.predict(batches)
    assert out.shape == (24, 3)
    torch.testing.assert_close(out, model.predict(torch.cat([x for x, _ in batches])))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(batches[0][0]), batch_size=5
    )
    assert model.predict(loader).shape == (8, 3)


# -- 10. a DataLoader with its own generator resumes exactly ---------------------------------
def _loader(seed: int) -> torch.utils.data.DataLoader[Any]:
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long()
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y),
        batch_size=8,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )


@pytest.mark.filterwarnings("ignore:.*not in this run")
@pytest.mark.parametrize("name", ["CKP-1_4.pt", "CKP-2_2.pt"])
def test_dataloader_generator_is_saved_and_restored(tmp_path: Path, name: str) -> None:
    straight = make_model()
    straight.train(3, _loader(1))
    config = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=10)
    make_model().train(
        2, _loader(1), callbacks=[ModelCheckpoint(directory=tmp_path, config=config)]
    )
    resumed = make_model(seed=5)
    resumed.train(3, _loader(99), resume_from=tmp_path / name)  # another seed: restored anyway
    for a, b in zip(straight.train_network.parameters(), resumed.train_network.parameters()):
        assert torch.equal(a, b)


# -- 6. the run store's path is checked when RunRecorder is created --------------------------
def test_recorder_db_that_cannot_be_a_run_store_is_refused_at_construction(tmp_path: Path) -> None:
    import sqlite3

    from stepwatch import RunRecorder

    with pytest.raises(ValueError, match="is a folder; pass a database file"):
        RunRecorder(db=tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("hello, not a database at all")
    with pytest.raises(ValueError, match="is not an SQLite database"):
        RunRecorder(db=text)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE customers (id INTEGER)")
    with pytest.raises(ValueError, match="an SQLite database of something else"):
        RunRecorder(db=other)
    with pytest.raises(ValueError, match="cannot be created"):
        RunRecorder(db=text / "x.db")
    RunRecorder(db=tmp_path / "new" / "runs.db")  # a new file in a new folder is fine
