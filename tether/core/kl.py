"""KL estimators and KL-coefficient controllers (SPEC B5, B11). Pure functions / tiny classes on floats.

The per-token penalty estimates KL(π‖π_ref) from tokens sampled by π. With r = π_ref(a|s)/π(a|s):
  k1 = −log r = log π − log π_ref        (unbiased, can be negative)
  k2 = ½ (log r)²                        (biased, low variance, ≥ 0)
  k3 = (r − 1) − log r                   (unbiased, ≥ 0; Schulman, "Approximating KL divergence", 2020),
                                         clipped at 10 by default as veRL and OpenRLHF do (``k3_clip``)
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
K3_CLIP = 10.0  # veRL's low_var_kl and OpenRLHF's compute_approx_kl clamp k3 to [−10, 10]; TRL does not


def kl_penalty(logprobs: torch.Tensor, logprobs_ref: torch.Tensor, estimator: str = "k1",
               k3_clip: float = K3_CLIP) -> torch.Tensor:
    """Per-token KL estimate (B, T) from log π (``logprobs``) and log π_ref (``logprobs_ref``).

    k3 is clipped to at most ``k3_clip`` (``kl.k3_clip``; 0 = off, as TRL): k3 = min((r − 1) − log r, k3_clip).
    The default 10 is veRL's and OpenRLHF's; it binds where log r > 2.61 (π_ref/π > 13.6) or log r < −11.0, and a
    clipped token adds no gradient (``--kl-in loss``). Unclipped, one token at log r = 11.9 has k3 = 1.47e5: as a
    loss term it is the update after the gradient-norm clip. Before ``exp`` the log-ratio is clamped to
    [−20, 20] so a token that π nearly never samples cannot overflow.
    """
    log_r = logprobs_ref - logprobs  # log(π_ref/π), (B, T)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        log_r = log_r.clamp(-20.0, 20.0)
        k3 = torch.expm1(log_r) - log_r
        return k3.clamp(max=k3_clip) if k3_clip > 0 else k3
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")


class FixedKLController:
    """β stays at its initial value."""

    def __init__(self, init_kl_coef: float):
        self.value = float(init_kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    """Doubling/halving rule (B11; Schulman et al. 2017 §4): β×2 when KL > 1.5·target,
    β/2 when KL < target/1.5, unchanged between."""

    def __init__(self, init_kl_coef: float, target: float, factor: float = 2.0, threshold: float = 1.5):
        super().__init__(init_kl_coef)
        self.target, self.factor, self.threshold = float(target), float(factor), float(threshold)

    def update(self, current_kl: float, n_steps: int) -> None:
        if current_kl > self.threshold * self.target:
            self.value *= self.factor
        elif current_kl < self.target / self.threshold:
            self.value /= self.factor


class ProportionalKLController(FixedKLController):
    """Ziegler et al. 2019 (§2.2): e = clip(KL/target − 1, −0.2, 0.2); β ← β·(1 + e·n_steps/horizon).

    ``n_steps`` is the number of samples (rollouts) in the step; ``horizon`` sets how fast β moves.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float = 10000.0):
        super().__init__(init_kl_coef)
        self.target, self.horizon = float(target), float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(kind: str, init_kl_coef: float, target: float, horizon: float = 10000.0):
    """Build the controller named ``kind`` (``fixed`` | ``adaptive`` | ``proportional``)."""
    if kind == "fixed":
        return FixedKLController(init_kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(init_kl_coef, target)
    if kind == "proportional":
        return ProportionalKLController(init_kl_coef, target, horizon)
    raise ValueError(f"unknown KL controller {kind!r}")
