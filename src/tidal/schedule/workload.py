"""Workload models for the simulator: how long each rollout takes and how many tokens it
trains.

- `LognormalWorkload`: durations lognormal with a given mean and tail (sigma, or a
  target p99); tokens proportional to duration (`tokens_per_s`) times a lognormal
  noise factor.
- `EmpiricalWorkload`: resamples (duration, tokens) pairs, e.g. from a recorded run's
  ledger (`from_ledger`), optionally rescaled in time.
- `DriftingWorkload`: a non-stationary wrapper. RL runs show sessions lengthening as
  the policy learns to do more (more turns, more tool calls); session `i`'s base draw
  is scaled by a factor that grows with `i` (submission order, a proxy for training
  progress), from 1x to `growth` x over `over_sessions` sessions, durations and tokens
  each with their own growth. A fixed rollout/train split tuned to the average is then
  wrong at both ends of the run; an elastic one can follow.

Session `i` gets the same draw in every simulation with the same seed, whatever the
policy: draws come in fixed-size chunks, chunk `j` from `default_rng([seed, j])`
(an indexed model, such as `DriftingWorkload`, is also told where the chunk starts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

Z99 = 2.3263478740408408  # standard normal quantile at 0.99


class WorkloadModel(Protocol):
    def draw(self, rng: np.random.Generator, n: int) -> tuple[FloatArray, IntArray]:
        """`n` sessions: durations in seconds, trained tokens."""
        ...

    def describe(self) -> dict[str, object]: ...


@runtime_checkable
class IndexedWorkloadModel(WorkloadModel, Protocol):
    """A model whose draws depend on where the sessions fall in the run (non-stationary):
    `SessionTable` calls `draw_at(rng, start, n)` for sessions `start .. start + n - 1`."""

    def draw_at(
        self, rng: np.random.Generator, start: int, n: int
    ) -> tuple[FloatArray, IntArray]: ...


@dataclass(frozen=True)
class LognormalWorkload:
    """Lognormal durations with mean `mean_s` and shape `sigma`.

    p99 = exp(mu + 2.326 sigma) with mu = ln(mean) - sigma^2 / 2. `sigma=0.5` with a
    2 h mean gives a median of 1.76 h and a p99 of 5.6 h. Tokens = duration x
    `tokens_per_s` x lognormal(0, `token_sigma`) noise (mean 1).
    """

    mean_s: float = 7200.0
    sigma: float = 0.5
    tokens_per_s: float = 120.0
    token_sigma: float = 0.2

    def __post_init__(self) -> None:
        if self.mean_s <= 0 or self.sigma < 0 or self.tokens_per_s < 0 or self.token_sigma < 0:
            raise ValueError("mean_s must be > 0; sigma, tokens_per_s, token_sigma >= 0")

    @classmethod
    def from_p99(cls, mean_s: float, p99_s: float, **kw: float) -> LognormalWorkload:
        """The sigma whose p99 is `p99_s` for the given mean (the smaller root)."""
        r = math.log(p99_s / mean_s)
        # p99/mean = exp(Z sigma - sigma^2/2): sigma^2/2 - Z sigma + r = 0
        disc = Z99 * Z99 - 2 * r
        if disc < 0:
            raise ValueError(f"no lognormal has mean {mean_s} and p99 {p99_s}")
        return cls(mean_s=mean_s, sigma=Z99 - math.sqrt(disc), **kw)

    @property
    def mu(self) -> float:
        return math.log(self.mean_s) - self.sigma**2 / 2

    def quantile(self, q: float) -> float:
        from statistics import NormalDist

        return math.exp(self.mu + self.sigma * NormalDist().inv_cdf(q))

    def draw(self, rng: np.random.Generator, n: int) -> tuple[FloatArray, IntArray]:
        dur = rng.lognormal(self.mu, self.sigma, n)
        noise = rng.lognormal(-self.token_sigma**2 / 2, self.token_sigma, n)
        tok = np.maximum(1, np.rint(dur * self.tokens_per_s * noise)).astype(np.int64)
        return dur, tok

    def describe(self) -> dict[str, object]:
        return {
            "kind": "lognormal",
            "mean_s": self.mean_s,
            "sigma": self.sigma,
            "median_s": self.quantile(0.5),
            "p99_s": self.quantile(0.99),
            "tokens_per_s": self.tokens_per_s,
            "mean_tokens": self.mean_s * self.tokens_per_s,
        }


@dataclass(frozen=True)
class EmpiricalWorkload:
    """Resample recorded (duration, tokens) pairs with replacement.

    `time_scale` multiplies durations (a short recorded run can stand in for long
    sessions with the same shape); `token_scale` multiplies tokens.
    """

    durations_s: tuple[float, ...]
    tokens: tuple[int, ...]
    time_scale: float = 1.0
    token_scale: float = 1.0
    source: str = ""
    _arr: tuple[FloatArray, IntArray] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.durations_s or len(self.durations_s) != len(self.tokens):
            raise ValueError("need one or more (duration, tokens) pairs of equal length")
        d = np.asarray(self.durations_s, np.float64)
        if (d < 0).any():
            raise ValueError("durations must be >= 0")
        object.__setattr__(
            self, "_arr", (d, np.asarray(self.tokens, np.int64))
        )

    def draw(self, rng: np.random.Generator, n: int) -> tuple[FloatArray, IntArray]:
        d, t = self._arr
        idx = rng.integers(0, d.shape[0], n)
        dur = d[idx] * self.time_scale
        tok = np.maximum(1, np.rint(t[idx] * self.token_scale)).astype(np.int64)
        return dur, tok

    def describe(self) -> dict[str, object]:
        d = np.asarray(self.durations_s) * self.time_scale
        return {
            "kind": "empirical",
            "source": self.source,
            "sessions": len(self.durations_s),
            "mean_s": float(d.mean()),
            "median_s": float(np.median(d)),
            "p99_s": float(np.quantile(d, 0.99)),
            "mean_tokens": float(np.mean(self.tokens)) * self.token_scale,
            "time_scale": self.time_scale,
        }

    @classmethod
    def from_ledger(
        cls,
        path: str | Path,
        *,
        time_scale: float = 1.0,
        token_scale: float = 1.0,
        mean_s: float | None = None,
        include_subagents: bool = True,
    ) -> EmpiricalWorkload:
        """Read a recorded run's ledger: per top-level session, duration = last call's
        end - first call's start (subagent sessions folded into their parent), tokens =
        unique tokens (each call's new prompt suffix + its output; what tree training
        processes). `mean_s` rescales durations so that their mean is `mean_s`."""
        from tidal.ledger import LedgerStore

        store = LedgerStore(path, readonly=True)
        try:
            infos = {s.session_id: s for s in store.sessions()}
            span: dict[str, list[float]] = {}
            toks: dict[str, int] = {}
            for sid, info in infos.items():
                root = sid
                seen = {sid}
                while include_subagents and infos[root].parent_session_id in infos:
                    parent = infos[root].parent_session_id
                    assert parent is not None
                    if parent in seen:
                        break
                    seen.add(parent)
                    root = parent
                if not include_subagents and info.parent_session_id is not None:
                    continue
                log = store.call_log(sid)
                for sc in log.calls:
                    c = sc.call
                    sp = span.setdefault(root, [math.inf, -math.inf])
                    sp[0] = min(sp[0], c.started_at)
                    sp[1] = max(sp[1], c.ended_at)
                    toks[root] = (
                        toks.get(root, 0)
                        + int(sc.prompt.suffix_ids.shape[0])
                        + int(c.output_ids.shape[0])
                    )
        finally:
            store.close()
        roots = [r for r in span if math.isfinite(span[r][0])]
        if not roots:
            raise ValueError(f"{path}: the ledger has no calls to build a workload from")
        durs = tuple(max(0.0, span[r][1] - span[r][0]) for r in roots)
        scale = time_scale
        if mean_s is not None:
            m = sum(durs) / len(durs)
            if m <= 0:
                raise ValueError(f"{path}: recorded sessions have zero duration")
            scale = mean_s / m
        return cls(
            durations_s=durs,
            tokens=tuple(toks[r] for r in roots),
            time_scale=scale,
            token_scale=token_scale,
            source=str(path),
        )


def _num(x: object) -> float:
    if not isinstance(x, int | float):
        raise TypeError(f"expected a number, got {x!r}")
    return float(x)


GrowthShape = Literal["linear", "geometric"]
GROWTH_SHAPES: tuple[GrowthShape, ...] = ("linear", "geometric")


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class DriftingWorkload:
    """`base`'s sessions, lengthening over the run.

    Session `i` (submission order) draws what `base` would draw for it, then its
    duration is multiplied by `factor(i)` and its tokens by
    `factor(i, token_growth)` (`token_growth=None`: the same as `growth`), where the
    progress is `p = min(1, i / over_sessions)` and the factor `1 + (g - 1) p`
    (`shape="linear"`) or `g ** p` (`"geometric"`). Sessions past `over_sessions` keep
    the final factor. Set `over_sessions` to the run's target samples (the sessions
    it trains, roughly in order) so that the last trained sessions are `growth` x the
    first.

    Equal growth of durations and tokens keeps the rollout/train cost ratio; unequal
    growth moves it, which is where a fixed split loses most. `growth < 1` shrinks.
    A drifting `base` drifts too (the factors multiply).
    """

    base: WorkloadModel = field(default_factory=LognormalWorkload)
    growth: float = 3.0
    over_sessions: int = 8192
    token_growth: float | None = None
    shape: GrowthShape = "linear"

    def __post_init__(self) -> None:
        _check_positive("growth", self.growth)
        if self.token_growth is not None:
            _check_positive("token_growth", self.token_growth)
        if isinstance(self.over_sessions, bool) or not isinstance(self.over_sessions, int):
            raise ValueError(f"over_sessions must be an int >= 1, got {self.over_sessions!r}")
        if self.over_sessions < 1:
            raise ValueError(f"over_sessions must be >= 1, got {self.over_sessions}")
        if self.shape not in GROWTH_SHAPES:
            raise ValueError(
                f"shape must be one of {', '.join(GROWTH_SHAPES)}, got {self.shape!r}"
            )
        if not callable(getattr(self.base, "draw", None)):
            raise ValueError(f"base must be a workload model (with draw), got {self.base!r}")

    @property
    def tokens_growth(self) -> float:
        """The tokens' growth (`token_growth`, or `growth` when that is None)."""
        return self.growth if self.token_growth is None else self.token_growth

    def progress(self, idx: npt.ArrayLike) -> FloatArray:
        """Training progress of sessions `idx`: 0 for the first, 1 from `over_sessions`."""
        return np.minimum(1.0, np.asarray(idx, np.float64) / self.over_sessions)

    def factor(self, idx: npt.ArrayLike, growth: float | None = None) -> FloatArray:
        """How much the draws of sessions `idx` are scaled: durations by default,
        tokens with `growth=self.tokens_growth`."""
        g = self.growth if growth is None else growth
        p = self.progress(idx)
        if self.shape == "geometric":
            return np.power(g, p)
        return 1.0 + (g - 1.0) * p

    def draw_at(
        self, rng: np.random.Generator, start: int, n: int
    ) -> tuple[FloatArray, IntArray]:
        """Sessions `start .. start + n - 1`: `base`'s draw from `rng`, scaled."""
        if start < 0 or n < 0:
            raise ValueError(f"start and n must be >= 0, got start={start}, n={n}")
        base = self.base
        if isinstance(base, IndexedWorkloadModel):  # drifts stack: the factors multiply
            dur, tok = base.draw_at(rng, start, n)
        else:
            dur, tok = base.draw(rng, n)
        idx = np.arange(start, start + n)
        dur = dur * self.factor(idx)
        scaled = tok * self.factor(idx, self.tokens_growth)
        return dur, np.maximum(1, np.rint(scaled)).astype(np.int64)

    def draw(self, rng: np.random.Generator, n: int) -> tuple[FloatArray, IntArray]:
        """The run's first `n` sessions (`draw_at` for any others)."""
        return self.draw_at(rng, 0, n)

    def describe(self) -> dict[str, object]:
        """What it is, and its sessions over one run of `over_sessions` (seed 0):
        `mean_s`, `median_s`, `p99_s`, `mean_tokens`; `first` and `last` are the
        means at the start (the base's) and from `over_sessions` on."""
        n = min(self.over_sessions, 200_000)
        table = SessionTable(self, 0)
        table.ensure(n)
        d, t = table.durations[:n], table.tokens[:n]
        base = self.base.describe()
        first = {"mean_s": _num(base["mean_s"]), "mean_tokens": _num(base["mean_tokens"])}
        end = self.over_sessions
        last = {
            "mean_s": first["mean_s"] * float(self.factor(end)),
            "mean_tokens": first["mean_tokens"] * float(self.factor(end, self.tokens_growth)),
        }
        return {
            "kind": "drifting",
            "summary": self.label(),
            "base": base,
            "growth": self.growth,
            "token_growth": self.tokens_growth,
            "shape": self.shape,
            "over_sessions": self.over_sessions,
            "mean_s": float(d.mean()),
            "median_s": float(np.median(d)),
            "p99_s": float(np.quantile(d, 0.99)),
            "mean_tokens": float(t.mean()),
            "first": first,
            "last": last,
        }

    def label(self) -> str:
        """One line: what drifts, how much, over how many sessions."""
        if self.tokens_growth == self.growth:
            what = f"durations and tokens x{self.growth:g}"
        else:
            what = f"durations x{self.growth:g}, tokens x{self.tokens_growth:g}"
        return f"{what} ({self.shape}) over {self.over_sessions} sessions"


class SessionTable:
    """Per-session (duration, tokens), drawn lazily in fixed chunks so that session `i`
    is the same in every run with the same seed."""

    CHUNK = 4096

    def __init__(self, model: WorkloadModel | None, seed: int = 0) -> None:
        self.model = model
        self.seed = seed
        self.durations: FloatArray = np.zeros(0)
        self.tokens: IntArray = np.zeros(0, np.int64)

    @classmethod
    def fixed(cls, durations: list[float], tokens: list[int] | int) -> SessionTable:
        """Exactly these sessions, in order (hand-computed tests, recorded replays)."""
        t = cls(None)
        t.durations = np.asarray(durations, np.float64)
        toks = [tokens] * len(durations) if isinstance(tokens, int) else tokens
        t.tokens = np.asarray(toks, np.int64)
        if t.tokens.shape != t.durations.shape:
            raise ValueError("durations and tokens differ in length")
        return t

    def ensure(self, n: int) -> None:
        have = self.durations.shape[0]
        if n <= have:
            return
        if self.model is None:
            raise ValueError(f"this fixed session table has only {have} sessions, {n} needed")
        ds, ts = [self.durations], [self.tokens]
        j = have // self.CHUNK
        model = self.model
        while have < n:
            rng = np.random.default_rng([self.seed, j])
            if isinstance(model, IndexedWorkloadModel):
                d, t = model.draw_at(rng, j * self.CHUNK, self.CHUNK)
            else:
                d, t = model.draw(rng, self.CHUNK)
            ds.append(d)
            ts.append(t)
            have += self.CHUNK
            j += 1
        self.durations = np.concatenate(ds)
        self.tokens = np.concatenate(ts)
