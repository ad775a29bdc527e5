"""The step profile's fit: least squares over timed steps (`kvpilot.sim.calibrate`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpilot.errors import ConfigError
from kvpilot.sim.measured import StepSample
from kvpilot.sim.profile import PROFILE_FEATURES, StepProfile

IRLS_ROUNDS = 4  # reweightings of the fit by its own prediction (converged well before)


def fit_profile(
    samples: Sequence[StepSample],
    *,
    model: str,
    device: str = "cpu",
    dtype: str = "float32",
    block_size: int = 16,
    copy_block_s: float = 0.0,
    trim: float = 0.0,
    max_model_len: int = 0,
    max_context_tokens: int = 0,
) -> StepProfile:
    """Least squares in relative error, coefficients >= 0, weighted by the fitted step time.

    A replay's time is a sum of step times, so the profile must get their mean right. Plain
    relative least squares (each step weighted by its measured time) does not: it pulls the
    fit below the mean by about the squared spread of the measurements (~5-10% on a shared
    machine, where the same shape takes 20% longer now and then). So the weights are
    refitted from the model's own prediction (iteratively reweighted least squares: the
    maximum likelihood fit when the spread is proportional to the time), which is unbiased.
    ``trim`` > 0 drops that fraction of worst-fitting steps first (contention slows replays
    just as much, so dropping the slow steps would bias the fit low again: off by default).
    """
    if len(samples) < 2 * len(PROFILE_FEATURES):
        raise ConfigError(
            f"calibration needs at least {2 * len(PROFILE_FEATURES)} timed steps, "
            f"got {len(samples)}"
        )
    x = np.asarray([s.shape.features() for s in samples], dtype=float)
    y = np.asarray([s.seconds for s in samples], dtype=float)
    coef = _nnls_weighted(x, y, 1.0 / y)
    if trim > 0:
        rel = np.abs(x @ coef - y) / y
        keep = rel <= np.quantile(rel, 1.0 - trim)
        x, y = x[keep], y[keep]
        coef = _nnls_weighted(x, y, 1.0 / y)
    floor = 1e-3 * float(np.median(y))
    for _ in range(IRLS_ROUNDS):
        coef = _nnls_weighted(x, y, 1.0 / np.maximum(x @ coef, floor))
    pred = x @ coef
    rel = np.abs(pred - y) / y
    ss_res = float(((pred - y) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return StepProfile(
        model=model,
        device=device,
        dtype=dtype,
        block_size=block_size,
        coefficients_s=tuple(float(c) for c in coef),
        copy_block_s=copy_block_s,
        samples=len(samples),
        r2=1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
        median_rel_error=float(np.median(rel)),
        max_model_len=max_model_len,
        max_context_tokens=max_context_tokens,
    )


def _nnls_weighted(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Minimise sum((w * (x @ c - y))^2) with c >= 0 by dropping negative features in turn."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            return coef
        del active[int(np.argmin(sol))]
    return coef
