"""The torch-free anomaly detectors: argument checks, firing on synthetic faults within a bounded
delay, once per episode, silence on healthy synthetic runs, and bounded memory."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pytest

from stepwatch.monitor.detector_specs import make_detectors
from stepwatch.monitor.detectors import (
    DETECTORS,
    Alert,
    Divergence,
    DyingReLU,
    GradExplosion,
    GradVanishing,
    NonFinite,
    NotLearning,
    Overfitting,
    Plateau,
    RecurringBatch,
    Spike,
    Threshold,
    WorseThanChance,
)

N = 5000


def feed(detector: Any, values: Iterable[Any], start: int = 1) -> list[Alert]:
    alerts = []
    for step, value in enumerate(values, start):
        alert = detector.update(step, value)
        if alert is not None:
            alerts.append(alert)
    return alerts


# ---- healthy synthetic runs (each seeded; each is a loss that a watcher should leave alone) ----


def decay(t: np.ndarray) -> np.ndarray:
    return 0.3 + 2.0 * np.exp(-t / 800.0)


def noisy_decay(rng: np.random.Generator) -> np.ndarray:
    t = np.arange(N, dtype=float)
    return decay(t) * rng.lognormal(0.0, 0.1, N)


def student_t_noise(rng: np.random.Generator) -> np.ndarray:
    t = np.arange(N, dtype=float)
    return decay(t) * np.abs(1.0 + 0.01 * rng.standard_t(3, N))


def lognormal_noise(rng: np.random.Generator) -> np.ndarray:
    t = np.arange(N, dtype=float)
    return decay(t) * rng.lognormal(0.0, 0.25, N)


def _lagged(x: np.ndarray, span: float) -> np.ndarray:
    out, level = np.empty_like(x), x[0]
    for i, v in enumerate(x):
        level += (v - level) / span
        out[i] = level
    return out


def cosine_restarts(rng: np.random.Generator) -> np.ndarray:
    # SGDR: the LR jumps back up every 1000 steps and the loss bumps up ~40% in response.
    t = np.arange(N, dtype=float)
    lr = 0.5 * (1.0 + np.cos(np.pi * (t % 1000) / 1000))
    return decay(t) * (1.0 + 0.4 * _lagged(lr, 20.0)) * rng.lognormal(0.0, 0.05, N)


def warmup_transient(rng: np.random.Generator) -> np.ndarray:
    # The loss climbs from 2.3 to ~4 while the LR warms up, then falls.
    t = np.arange(N, dtype=float)
    bump = 1.7 * np.exp(-(((t - 60.0) / 30.0) ** 2))
    return (decay(t) + bump) * rng.lognormal(0.0, 0.05, N)


def step_lr(rng: np.random.Generator) -> np.ndarray:
    t = np.arange(N, dtype=float)
    drops = np.where(t >= 2000, 0.6, 1.0) * np.where(t >= 3500, 0.6, 1.0)
    return decay(t) * drops * rng.lognormal(0.0, 0.05, N)


HEALTHY: list[Callable[[np.random.Generator], np.ndarray]] = [
    noisy_decay,
    student_t_noise,
    lognormal_noise,
    cosine_restarts,
    warmup_transient,
    step_lr,
]


@pytest.mark.parametrize("make", HEALTHY, ids=lambda f: f.__name__)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loss_detectors_stay_quiet_on_healthy_runs(make: Callable, seed: int) -> None:
    values = make(np.random.default_rng(seed))
    for detector in (NonFinite(), Spike(), Divergence()):
        assert feed(detector, values) == [], type(detector).__name__


# ---- nonfinite ----


def test_nonfinite_args_validation() -> None:
    with pytest.raises(TypeError, match="'name' must be a non-empty str"):
        NonFinite(name=3)


def test_nonfinite_fires_at_the_step_once_per_episode() -> None:
    values = [1.0] * 20
    values[9] = float("nan")
    values[10] = float("inf")  # same episode
    values[15] = float("-inf")  # finite values in between: a new episode
    alerts = feed(NonFinite(), values)
    assert [a.step for a in alerts] == [10, 16]
    assert alerts[0].kind == "nonfinite"
    assert "lower the learning rate" in alerts[0].message
    assert "check the input batch" in alerts[0].message


# ---- spike ----


def test_spike_args_validation() -> None:
    with pytest.raises(TypeError, match="'window' must be an int"):
        Spike(window=10.0)
    with pytest.raises(ValueError, match="'window' must be an int >= 3"):
        Spike(window=1)
    with pytest.raises(ValueError, match="'min_ratio' must be >= 1"):
        Spike(min_ratio=0.5)
    with pytest.raises(ValueError, match="'warmup' must be <= window"):
        Spike(window=10, warmup=20)
    with pytest.raises(TypeError, match="'z' must be a number"):
        Spike(z="8")
    with pytest.raises(ValueError, match="'floor' must be >= 0"):
        Spike(floor=-0.1)
    with pytest.raises(ValueError, match="'level_window' must be an int >= 1"):
        Spike(level_window=0)
    with pytest.raises(ValueError, match="'lone_ratio' must be >= 1"):
        Spike(lone_ratio=0.5)
    assert Spike().warmup == 16  # a spike at step 50 of a short run is judged
    assert Spike(window=10).warmup == 5  # the default warm-up follows a small window


def test_spike_fires_on_the_spike_step_and_not_during_warmup() -> None:
    values = noisy_decay(np.random.default_rng(0))
    values[9] *= 10  # inside the warm-up: too early to judge
    values[1999] *= 40
    alerts = feed(Spike(), values)
    assert [a.step for a in alerts] == [2000]
    assert alerts[0].value == pytest.approx(values[1999])
    assert "check the input batch" in alerts[0].message


def test_spike_flat_low_noise_loss_ignores_tiny_wiggles() -> None:
    rng = np.random.default_rng(3)
    values = 0.05 + 1e-6 * rng.standard_normal(N)
    values[3000] = 0.06  # 20% up: thousands of MADs, but not a real spike
    assert feed(Spike(), values) == []


def test_spike_fires_once_per_episode() -> None:
    values = noisy_decay(np.random.default_rng(1))
    values[2000:2100] *= 5  # a sustained jump: one alert
    values[3000:3003] *= 5  # after it cleared: a second
    alerts = feed(Spike(z=10, peak_ratio=None), values)
    assert [a.step for a in alerts] == [2001, 3001]
    for every in (8, 128):  # read in batches, as AnomalyMonitor reads them: the same
        assert [a.step for a in chunked(Spike(z=10, peak_ratio=None), values, every)] == [
            2001,
            3001,
        ]


# ---- divergence ----


def test_divergence_args_validation() -> None:
    with pytest.raises(ValueError, match="'factor' must be >= 1"):
        Divergence(factor=0.5)
    with pytest.raises(ValueError, match="'level_window' must be an int >= 1"):
        Divergence(level_window=0)
    with pytest.raises(TypeError, match="'patience' must be an int"):
        Divergence(patience=None)


def test_divergence_fires_within_ten_steps_of_a_blow_up() -> None:
    values = noisy_decay(np.random.default_rng(0))
    onset = 3000
    values[onset:] = values[onset:] * 10.0 * 1.05 ** np.arange(N - onset)
    alerts = feed(Divergence(), values, start=0)
    assert len(alerts) == 1
    assert onset <= alerts[0].step <= onset + 10
    assert "lower the learning rate" in alerts[0].message


def test_divergence_fires_soon_after_a_gradual_run_away_doubles_the_loss() -> None:
    values = noisy_decay(np.random.default_rng(1))
    values[3000:] = values[3000:] * 1.01 ** np.arange(N - 3000)
    doubled = 3000 + int(np.log(2) / np.log(1.01))
    alerts = feed(Divergence(), values, start=0)
    assert len(alerts) == 1
    assert doubled <= alerts[0].step <= doubled + 40


def test_divergence_fires_once_per_episode() -> None:
    rng = np.random.default_rng(2)
    values = 1.0 * rng.lognormal(0.0, 0.05, N)
    values[1000:1500] *= 5  # sustained
    values[3000:3500] *= 5  # recurs after recovering
    alerts = feed(Divergence(), values, start=0)
    assert len(alerts) == 2
    assert 1000 <= alerts[0].step <= 1010
    assert 3000 <= alerts[1].step <= 3010


# ---- plateau ----


def test_plateau_args_validation() -> None:
    with pytest.raises(ValueError, match="'patience' must be an int >= 1"):
        Plateau(patience=0)
    with pytest.raises(ValueError, match="'min_rel_improvement' must be a number with 0 < x < 1"):
        Plateau(min_rel_improvement=1.0)


def test_plateau_fires_on_a_flat_loss_within_patience() -> None:
    rng = np.random.default_rng(0)
    values = 2.0 * rng.lognormal(0.0, 0.05, N)  # stuck from the start: slow convergence
    alerts = feed(Plateau(patience=500), values)
    assert len(alerts) == 1  # sustained for 4,500 steps: once
    assert 500 < alerts[0].step <= 500 + 100  # the EMA settles in its first ~70 steps
    assert "raise the learning rate" in alerts[0].message


def test_plateau_fires_on_a_zero_learning_rate_after_lr_patience_steps() -> None:
    rng = np.random.default_rng(0)
    plateau = Plateau(lr_patience=100)
    alerts = []
    for step, value in enumerate(2.0 * rng.lognormal(0.0, 0.05, 1000), 1):
        plateau.lr = 0.1 if step < 300 or step > 700 else 0.0
        alerts.append(plateau.update(step, value))
    fired = [a for a in alerts if a is not None and "learning rate is 0" in a.message]
    assert [a.step for a in fired] == [300]  # names the first step at 0, once per episode
    assert "learning rate is 0 (seen from step 300 on)" in fired[0].message


def test_plateau_leaves_a_run_that_learned_then_levelled_off_alone() -> None:
    t = np.arange(N, dtype=float)
    level = 0.5 + 2.0 * np.exp(-np.minimum(t, 2000) / 500.0)  # converged at step 2000
    values = level * np.random.default_rng(1).lognormal(0.0, 0.05, N)
    assert feed(Plateau(patience=500), values, start=0) == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plateau_stays_quiet_on_slow_but_steady_improvement(seed: int) -> None:
    rng = np.random.default_rng(seed)
    t = np.arange(N, dtype=float)
    for level in (3.0 * np.exp(-t / 10000.0), 3.0 * (1.0 + t / 100.0) ** -0.5):  # ~5%/500
        assert feed(Plateau(), level * rng.lognormal(0.0, 0.05, N)) == []


def test_plateau_fires_again_after_real_progress_that_stalls_near_the_start() -> None:
    rng = np.random.default_rng(4)
    level = np.concatenate([np.full(1500, 2.0), np.linspace(2.0, 1.9, 200), np.full(1500, 1.9)])
    alerts = feed(Plateau(patience=500), level * rng.lognormal(0.0, 0.005, level.size))
    assert len(alerts) == 2
    assert 500 < alerts[0].step <= 600
    assert 1700 + 300 <= alerts[1].step <= 1700 + 500 + 300


# ---- grad_explosion ----


def grad_norms(rng: np.random.Generator) -> np.ndarray:
    t = np.arange(N, dtype=float)
    return (1.0 + 5.0 * np.exp(-t / 300.0)) * rng.lognormal(0.0, 0.4, N)


def test_grad_explosion_args_validation() -> None:
    with pytest.raises(ValueError, match="'factor' must be >= 1"):
        GradExplosion(factor=0.9)
    with pytest.raises(TypeError, match="'max_norm' must be a number or None"):
        GradExplosion(max_norm="10")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grad_explosion_quiet_on_healthy_norms(seed: int) -> None:
    assert feed(GradExplosion(), grad_norms(np.random.default_rng(seed))) == []


def test_grad_explosion_fires_on_the_step_once_per_episode() -> None:
    norms = grad_norms(np.random.default_rng(0))
    norms[3000:3005] *= 1000  # five exploding steps in a row: one alert
    norms[4000] *= 1000
    alerts = feed(GradExplosion(), norms)
    assert [a.step for a in alerts] == [3001, 4001]
    assert "clip gradients" in alerts[0].message


def test_grad_explosion_absolute_bound_applies_from_the_first_step() -> None:
    alerts = feed(GradExplosion(max_norm=100.0), [1.0, 500.0, 1.0, 2.0])
    assert [a.step for a in alerts] == [2]
    assert "gradient norm is 500, over max_norm 100" in alerts[0].message


# ---- grad_vanishing ----


def sigmoid_profile(rng: np.random.Generator) -> np.ndarray:
    # 12 layers; the first one's norm is 1e-10 of the last one's.
    return np.logspace(-10, 0, 12) * rng.lognormal(0.0, 0.2, 12)


def healthy_profile(rng: np.random.Generator) -> np.ndarray:
    return np.logspace(-2, 0, 12) * rng.lognormal(0.0, 0.2, 12)


def test_grad_vanishing_args_validation() -> None:
    with pytest.raises(ValueError, match="'ratio' must be a number with 0 < x < 1"):
        GradVanishing(ratio=2.0)
    with pytest.raises(TypeError, match="'norms' must be a sequence of floats"):
        GradVanishing().update(1, 0.5)  # type: ignore[arg-type]


def test_grad_vanishing_fires_after_patience_samples_once_per_episode() -> None:
    rng = np.random.default_rng(0)
    samples = [sigmoid_profile(rng) for _ in range(50)]
    samples += [healthy_profile(rng) for _ in range(10)]
    samples += [sigmoid_profile(rng) for _ in range(10)]
    alerts = feed(GradVanishing(patience=5), samples)
    assert [a.step for a in alerts] == [1, 61]  # the first step of each streak of 5
    assert "layer 0" in alerts[0].message
    assert "residual connections" in alerts[0].message


def test_grad_vanishing_ignores_one_odd_sample_and_a_healthy_spread() -> None:
    rng = np.random.default_rng(1)
    samples = [healthy_profile(rng) for _ in range(N)]
    samples[100] = sigmoid_profile(rng)
    assert feed(GradVanishing(), samples) == []


# ---- dying_relu ----


def test_dying_relu_args_validation() -> None:
    with pytest.raises(ValueError, match="'threshold' must be a number with 0 < x <= 1"):
        DyingReLU(threshold=0.0)
    with pytest.raises(ValueError, match=r"dead fractions must be within \[0, 1\]"):
        DyingReLU().update(1, [0.5, 1.5])


def test_dying_relu_fires_on_a_dead_layer_once_per_episode() -> None:
    detector = DyingReLU(patience=5)
    healthy = [0.5, 0.45, 0.55]
    samples = [[0.5, 1.0, 0.5]] * 20 + [healthy] * 5 + [[0.5, 0.995, 0.5]] * 5
    alerts = feed(detector, samples)
    assert [a.step for a in alerts] == [1, 26]  # the first step of each streak of 5
    assert "layer 1" in alerts[0].message
    # counts with totals give the same answer
    detector.reset()
    hits = [detector.update(s, [10, 256], total=[20, 256]) for s in range(1, 6)]
    assert [a.step for a in hits if a] == [1]


def test_dying_relu_quiet_on_half_dead_layers() -> None:
    rng = np.random.default_rng(0)
    samples = np.clip(0.5 + 0.1 * rng.standard_normal((N, 8)), 0.0, 1.0)
    assert feed(DyingReLU(), samples) == []


# ---- overfitting ----


def test_overfitting_args_validation() -> None:
    with pytest.raises(ValueError, match="'patience' must be an int >= 1"):
        Overfitting(patience=0)
    with pytest.raises(ValueError, match="'min_rel_rise' must be a number"):
        Overfitting(min_rel_rise=-0.1)


def feed_evals(detector: Overfitting, train: np.ndarray, evals: np.ndarray) -> list[Alert]:
    out = [
        detector.update(i, float(a), float(b), epoch=i)
        for i, (a, b) in enumerate(zip(train, evals))
    ]
    return [a for a in out if a is not None]


def test_overfitting_fires_after_patience_rising_evaluations() -> None:
    n = 60
    train = 2.0 * np.exp(-np.arange(n) / 10.0)
    evals = np.concatenate([np.linspace(2.0, 1.0, 21), 1.0 * 1.02 ** np.arange(1, 40)])
    alerts = feed_evals(Overfitting(patience=3), train, evals)
    assert [a.epoch for a in alerts] == [23]  # rises at 21, 22, 23; 6% above the best
    assert "regularisation" in alerts[0].message


def test_overfitting_fires_again_only_after_recovering() -> None:
    n = 60
    train = 2.0 * np.exp(-np.arange(n) / 10.0)
    rise = 1.0 * 1.02 ** np.arange(1, 11)
    evals = np.concatenate([[1.2, 1.1, 1.0], rise, [0.99] * 10, 0.99 * rise, [0.98] * 27])
    alerts = feed_evals(Overfitting(), train, evals)
    assert [a.epoch for a in alerts] == [5, 25]


def test_overfitting_needs_the_training_loss_to_fall() -> None:
    n = 30
    train = np.linspace(1.0, 3.0, n)  # both rise: divergence, not overfitting
    evals = np.linspace(1.0, 3.0, n)
    assert feed_evals(Overfitting(), train, evals) == []


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("noise", "min_rel_rise"), [(0.005, 0.03), (0.01, 0.06)])
def test_overfitting_quiet_on_a_noisy_flat_validation_loss(
    seed: int, noise: float, min_rel_rise: float
) -> None:
    # the default 3% suits eval noise up to ~0.5%; noisier evaluations need a larger min_rel_rise
    rng = np.random.default_rng(seed)
    n = 200
    train = 2.0 * np.exp(-np.arange(n) / 50.0)
    evals = 1.0 + noise * rng.standard_normal(n)
    assert feed_evals(Overfitting(min_rel_rise=min_rel_rise), train, evals) == []


# ---- threshold ----


def test_threshold_args_validation() -> None:
    with pytest.raises(ValueError, match="needs 'above' and/or 'below'"):
        Threshold("loss")
    with pytest.raises(TypeError, match="'above' must be a number or None"):
        Threshold("loss", above="1")
    with pytest.raises(TypeError, match="'name' must be a non-empty str"):
        Threshold(None, above=1.0)


def test_threshold_fires_on_each_crossing_once() -> None:
    detector = Threshold("eval_accuracy", above=0.9, below=0.1)
    alerts = feed(detector, [0.5, 0.95, 0.97, 0.5, 0.05, 0.02, 0.5, 0.92])
    assert [(a.step, a.message.split(" went ")[1].split()[0]) for a in alerts] == [
        (2, "above"),
        (5, "below"),
        (8, "above"),
    ]
    assert alerts[0].kind == "threshold" and "eval_accuracy" in alerts[0].message


# ---- registry ----


def test_registry_names_every_kind() -> None:
    assert set(DETECTORS) == {
        "nonfinite", "spike", "divergence", "plateau", "grad_explosion", "grad_vanishing",
        "dying_relu", "overfitting", "threshold", "not_learning", "lr_negligible",
        "recurring_batch", "saturation", "worse_than_chance",
    }  # fmt: skip
    assert all(cls.kind == kind for kind, cls in DETECTORS.items())


def test_make_detectors_specs() -> None:
    assert {d.kind for d in make_detectors()} == set(DETECTORS) - {"threshold"}
    assert [d.kind for d in make_detectors(["nonfinite", "spike"])] == ["nonfinite", "spike"]
    mine = Plateau(patience=10)
    built = make_detectors(
        {"spike": {"window": 20, "warmup": 10}, "plateau": mine, "threshold": {"above": 5.0}}
    )
    assert isinstance(built[0], Spike) and built[0].window == 20
    assert built[1] is mine
    assert isinstance(built[2], Threshold) and built[2].above == 5.0


def test_make_detectors_errors() -> None:
    with pytest.raises(ValueError, match="unknown detector kind 'nan'; known: 'nonfinite'"):
        make_detectors(["nan"])
    with pytest.raises(TypeError, match="'detectors' must be None, a list"):
        make_detectors("spike")
    with pytest.raises(TypeError, match="detector kinds must be str"):
        make_detectors([Spike])
    with pytest.raises(TypeError, match="options for 'spike' must be a dict"):
        make_detectors({"spike": 10})
    with pytest.raises(TypeError, match="must be a dict or a Spike"):
        make_detectors({"spike": Plateau()})
    with pytest.raises(ValueError, match="'window' must be an int >= 3"):
        make_detectors({"spike": {"window": 0}})


def test_reset_forgets_the_episode_and_history() -> None:
    detector = Spike(window=10, warmup=5)
    feed(detector, [1.0] * 10 + [9.0])
    detector.reset()
    assert feed(detector, [9.0] * 3) == []  # back in warm-up


def test_detectors_import_no_torch() -> None:
    import subprocess

    code = "import stepwatch.monitor.detectors, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---- bounded memory ----


def test_windows_stay_bounded_after_100k_updates() -> None:
    rng = np.random.default_rng(0)
    values = rng.lognormal(0.0, 0.1, 100_000)
    spike, explode, overfit = Spike(window=100), GradExplosion(), Overfitting(patience=3)
    plateau = Plateau(patience=300)
    for step, v in enumerate(values.tolist()):
        spike.update(step, v)
        explode.update(step, v)
        plateau.update(step, v)
        overfit.update(step, 1.0 / (step + 1), v)
    assert len(spike._values) == 100
    assert len(plateau._history) <= 301
    assert len(explode._first) == explode.warmup  # then two moving averages
    assert len(overfit._pairs) == 4
    # the rest keep a fixed set of numbers, no history at all
    divergence = Divergence()
    for step, v in enumerate(values.tolist()):
        divergence.update(step, v)
    assert len(divergence._recent) == 9
    assert len(divergence._values) == 100
    for detector in (NonFinite(), GradVanishing(), DyingReLU()):
        assert not any(isinstance(v, (list, dict, deque)) for v in vars(detector).values())


def test_spike_needs_a_jump_on_the_runs_scale_not_only_a_ratio_to_a_zero_median() -> None:
    with pytest.raises(ValueError, match="'min_jump' must be >= 0"):
        Spike(min_jump=-1)
    rng = np.random.default_rng(0)
    start = 2.0 * np.exp(-np.arange(300) / 40.0)  # learns, then most losses are exactly 0
    tail = np.where(rng.random(5000) < 0.3, rng.choice([1.5e-8, 3e-8, 5e-7], 5000), 0.0)
    assert feed(Spike(), np.concatenate([start, tail])) == []
    # a real jump still fires: one that stays up, or one alone over the run's whole scale
    for jump in ([0.5, 0.6], [2.5]):
        alerts = feed(Spike(), np.concatenate([start, tail, jump]))
        assert [a.step for a in alerts] == [5301]
    assert feed(Spike(), np.concatenate([start, tail, [0.5]])) == []  # alone, it may be a tail


# ---- right on scale: a jump judged against the loss's own recent scale ----


def falling_to(level: float, rng: np.random.Generator, n: int = 300) -> np.ndarray:
    """A short run's loss: from about twice ``level`` down to it within 40 steps, with the
    batch-to-batch noise of a batch of 16 (about 12%)."""
    t = np.arange(n, dtype=float)
    return level * (1.0 + 1.2 * np.exp(-t / 15.0)) * rng.lognormal(0.0, 0.12, n)


def chunked(detector: Any, values: np.ndarray, every: int = 8) -> list[Alert]:
    """As AnomalyMonitor reads them: ``every`` steps at a time."""
    found: list[Alert] = []
    for i in range(0, len(values), every):
        part = [float(v) for v in values[i : i + every]]
        found += detector.update_many(range(i + 1, i + 1 + len(part)), part)
    return found


@pytest.mark.parametrize("level", [0.3, 300.0, 3e-4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spike_catches_a_3x_jump_at_step_50_at_any_scale(level: float, seed: int) -> None:
    values = falling_to(level, np.random.default_rng(seed))
    values[49:56] = level * np.array([3.2, 4.0, 1.6, 1.2, 2.3, 2.1, 1.9])  # high for a while
    for every in (1, 8, 128):
        alerts = chunked(Spike(), values, every)
        assert [a.step for a in alerts] == [50], (every, alerts)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spike_ignores_a_jump_from_1e7_to_1e5_in_a_run_that_started_at_1(seed: int) -> None:
    rng = np.random.default_rng(seed)
    t = np.arange(3000, dtype=float)
    values = np.maximum(np.exp(-t / 100.0), 1e-7) * rng.lognormal(0.0, 0.1, t.size)
    values[2500] = 1e-5  # a hundredfold, on a loss of 1e-7: nothing on the run's scale
    assert chunked(Spike(), values) == []
    # the same jump where 1e-7 is the run's scale is one
    start = 1e-7 * rng.lognormal(0.0, 0.1, 3000)
    start[2500] = 1e-5
    assert [a.step for a in chunked(Spike(), start)] == [2501]


def zero_loss_run(rng: np.random.Generator, n: int = 6000) -> np.ndarray:
    """A separable task with batches of 4: learnt within 30 steps, then most step losses are
    exactly 0, the rest tiny, and now and then a batch with a sample near the boundary."""
    start = 0.7 * np.exp(-np.arange(30) / 6.0)
    tail = np.where(rng.random(n) < 0.6, 0.0, 1e-4 * rng.lognormal(0.0, 2.0, n))
    strays = rng.random(n) < 0.005
    tail[strays] = rng.uniform(0.01, 0.3, strays.sum())
    return np.concatenate([start * rng.lognormal(0.0, 0.1, 30), tail])


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_loss_detectors_stay_quiet_on_a_loss_that_reached_zero(seed: int) -> None:
    values = zero_loss_run(np.random.default_rng(seed))
    steps = range(1, values.size + 1)
    spe = 30
    for detector in (Spike(), Divergence(), Plateau(), NotLearning(), RecurringBatch()):
        if isinstance(detector, (Spike, RecurringBatch)):
            detector.steps_per_epoch = spe
        found = []
        for start in range(0, values.size, spe):
            part = [float(v) for v in values[start : start + spe]]
            found += detector.update_many(steps[start : start + spe], part, start // spe + 1)
        assert found == [], type(detector).__name__
    chance = WorseThanChance()
    chance.see_start(values[:16].tolist())
    epochs = values[: values.size // spe * spe].reshape(-1, spe).mean(1)
    assert [chance.update(e * spe, float(v), epoch=e) for e, v in enumerate(epochs, 1)] == [
        None
    ] * len(epochs)


def test_spike_leaves_a_batch_bad_every_epoch_to_the_recurring_batch_detector() -> None:
    rng = np.random.default_rng(5)
    spe = 64
    values = 0.3 * rng.lognormal(0.0, 0.1, spe * 6)
    values[40::spe] = 1.5  # batch 41 of every epoch
    spike = Spike()
    spike.steps_per_epoch = spe
    found = []
    for epoch in range(6):
        steps = range(epoch * spe + 1, (epoch + 1) * spe + 1)
        part = values[epoch * spe : (epoch + 1) * spe].tolist()
        found += spike.update_many(steps, part, epoch + 1)
    assert [a.step for a in found] == [41]  # its first time only
    # a spike elsewhere still fires
    assert [a.step for a in spike.update_many([400, 401], [1.5, 1.4], 7)] == [400]


# ---- grad_explosion: the running z-score of the log norm ----


def test_grad_explosion_judges_a_norm_against_its_own_spread() -> None:
    rng = np.random.default_rng(0)
    tight = rng.lognormal(0.0, 0.05, 200)
    tight[150] *= 12  # 12x where norms move by 5%: far out
    assert [a.step for a in feed(GradExplosion(), tight)] == [151]
    noisy = rng.lognormal(0.0, 0.6, 200)
    noisy[150] = 12 * np.median(noisy)  # 12x where norms swing by 2x: one of their tail
    assert feed(GradExplosion(), noisy) == []


def test_grad_explosion_keeps_a_blow_up_out_of_its_running_mean() -> None:
    rng = np.random.default_rng(1)
    norms = rng.lognormal(0.0, 0.1, 300)
    norms[100:160] *= 50  # sixty exploded norms in a row: one alert, nothing learnt from them
    norms[250] *= 20
    detector = GradExplosion()
    assert [a.step for a in feed(detector, norms)] == [101, 251]
    assert abs(detector._mean) < 0.2  # the log of the healthy norm, about 0


def test_grad_explosion_needs_only_a_few_norms_to_judge() -> None:
    with pytest.raises(ValueError, match="'warmup' must be an int >= 2"):
        GradExplosion(warmup=1)
    with pytest.raises(ValueError, match="'alpha' must be a number with 0 < x <= 1"):
        GradExplosion(alpha=0.0)
    norms = [1.0, 1.1, 0.9, 1.05, 0.95, 30.0]
    assert [a.step for a in feed(GradExplosion(), norms)] == [6]
    assert feed(GradExplosion(warmup=6), norms) == []
