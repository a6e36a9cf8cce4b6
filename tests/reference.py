"""A plain numpy, one-message-at-a-time reference of the default EWMA z-score detector."""

from __future__ import annotations

import numpy as np


class EWMAReference:
    """Processes messages one by one, exactly as the issue states the semantics (float64)."""

    def __init__(self, alpha: float = 0.05, threshold: float = 4.0, warmup: int = 20,
                 eps: float = 1e-6) -> None:
        self.alpha, self.threshold, self.warmup, self.eps = alpha, threshold, warmup, eps
        self.n: dict[str, int] = {}
        self.mean: dict[str, np.ndarray] = {}
        self.var: dict[str, np.ndarray] = {}

    def __call__(self, stream: str, x) -> tuple[np.ndarray, float, bool]:
        x = np.asarray(x, np.float64)
        n = self.n.get(stream, 0)
        if n == 0:
            z = np.zeros_like(x)
            self.mean[stream] = x.copy()
            self.var[stream] = np.zeros_like(x)
        else:
            d = x - self.mean[stream]
            z = d / np.sqrt(self.var[stream] + self.eps)
            self.mean[stream] = self.mean[stream] + self.alpha * d
            self.var[stream] = (1 - self.alpha) * (self.var[stream] + self.alpha * d * d)
        self.n[stream] = n + 1
        score = float(np.max(np.abs(z)))
        return z, score, bool(n >= self.warmup and score > self.threshold)
