"""`tidal simulate`: replay a workload on N devices under the three policies.

Heavy imports (numpy) happen inside the command so `tidal --help` stays fast. Every
option is checked before the simulation starts; a bad one is a usage error naming it
(docs/scheduler.md, "What bad input gets").
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from tidal.schedule.workload import WorkloadModel


def simulate(
    *,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    devices: Annotated[int, typer.Option(
        "--devices", "-n", min=2, help="Devices (GPUs); at least 2 (async splits them).")
    ] = 256,
    slots: Annotated[
        int, typer.Option(min=1, help="Concurrent sessions per rollout device.")
    ] = 4,
    batch: Annotated[
        int, typer.Option(min=0, help="Samples per optimizer step (0: devices x slots).")
    ] = 0,
    steps: Annotated[
        int, typer.Option(min=1, help="Optimizer steps to train (same for all).")
    ] = 8,
    staleness: Annotated[
        int, typer.Option(min=0, help="Max versions a trained sample may lag (async, elastic).")
    ] = 2,
    staleness_rule: Annotated[str, typer.Option(help="drop | downweight")] = "drop",
    mean_hours: Annotated[float, typer.Option(help="Mean rollout duration (h).")] = 2.0,
    sigma: Annotated[
        float, typer.Option(help="Lognormal shape of durations (tail weight).")
    ] = 0.5,
    p99_hours: Annotated[
        float, typer.Option(help="Set sigma from this p99 instead (h); 0: use --sigma.")
    ] = 0.0,
    tokens_per_s: Annotated[
        float, typer.Option(help="Trained tokens per second of rollout.")
    ] = 120.0,
    train_s_per_token: Annotated[
        float, typer.Option(help="Train device-seconds per token.")
    ] = 4.5e-4,
    step_overhead_s: Annotated[
        float, typer.Option(help="Optimizer step + weight sync (s).")
    ] = 30.0,
    switch_to_train_s: Annotated[float, typer.Option(help="Rollout -> train switch (s).")] = 8.5,
    switch_to_rollout_s: Annotated[float, typer.Option(help="Train -> rollout switch (s).")] = 3.5,
    migration: Annotated[
        bool, typer.Option(help="Elastic may pause+snapshot+resume sessions elsewhere.")
    ] = True,
    migrate_s: Annotated[float, typer.Option(help="Cost of one session migration (s).")] = 60.0,
    async_train: Annotated[
        int, typer.Option(min=0, help="Fix the async split's train devices (0: best split).")
    ] = 0,
    ledger: Annotated[
        Path | None, typer.Option(help="Take durations and tokens from this ledger store.")
    ] = None,
    ledger_mean_hours: Annotated[
        float, typer.Option(help="Rescale ledger durations to this mean (h); 0: as recorded.")
    ] = 0.0,
    seed: Annotated[int, typer.Option(min=0, help="Workload seed.")] = 0,
    growth: Annotated[float, typer.Option(
        help="Sessions lengthen over the run: the last trained are this many times the "
             "first (durations; tokens too unless --token-growth). 1: stationary.")
    ] = 1.0,
    token_growth: Annotated[float, typer.Option(
        help="Growth of the sessions' tokens over the run (0: the same as --growth).")
    ] = 0.0,
    decode_speedup: Annotated[float, typer.Option(
        help="Share of a full device's decode step that grows with the batch, in [0, 1]: "
             "sessions run faster as their device empties (0: no speedup).")
    ] = 0.0,
) -> None:
    """Compare colocated, fixed-split async and elastic scheduling on one workload."""
    from tidal.schedule.compare import Scenario, compare
    from tidal.schedule.types import StalenessRule

    _check_numbers(
        {"--mean-hours": mean_hours, "--tokens-per-s": tokens_per_s, "--sigma": sigma,
         "--p99-hours": p99_hours, "--train-s-per-token": train_s_per_token,
         "--step-overhead-s": step_overhead_s, "--switch-to-train-s": switch_to_train_s,
         "--switch-to-rollout-s": switch_to_rollout_s, "--migrate-s": migrate_s,
         "--ledger-mean-hours": ledger_mean_hours, "--growth": growth,
         "--token-growth": token_growth, "--decode-speedup": decode_speedup},
        positive=("--mean-hours", "--growth"),
    )
    if decode_speedup > 1:
        raise typer.BadParameter(f"must be in [0, 1], got {decode_speedup}",
                                 param_hint="--decode-speedup")
    rules = [r.value for r in StalenessRule]
    if staleness_rule not in rules:
        raise typer.BadParameter(f"{staleness_rule!r} is not one of {', '.join(rules)}",
                                 param_hint="--staleness-rule")
    if async_train >= devices:
        raise typer.BadParameter(f"{async_train} train devices leave no rollout device of "
                                 f"--devices {devices}", param_hint="--async-train")
    wl = _workload(ledger, ledger_mean_hours=ledger_mean_hours, mean_hours=mean_hours,
                   p99_hours=p99_hours, sigma=sigma, tokens_per_s=tokens_per_s)
    if growth != 1.0 or token_growth not in (0.0, growth):
        from tidal.schedule.workload import DriftingWorkload

        # the drift spans the sessions the run trains (steps x batch, in order)
        wl = DriftingWorkload(wl, growth=growth, token_growth=token_growth or None,
                              over_sessions=steps * (batch or devices * slots))
    try:
        sc = Scenario(
            n_devices=devices,
            slots_per_device=slots,
            batch_size=batch or None,
            steps=steps,
            max_staleness=staleness,
            staleness_rule=StalenessRule(staleness_rule),
            train_s_per_token=train_s_per_token,
            step_overhead_s=step_overhead_s,
            rollout_to_train_s=switch_to_train_s,
            train_to_rollout_s=switch_to_rollout_s,
            migration=migration,
            migrate_s=migrate_s,
            seed=seed,
            async_train=async_train or None,
            workload=wl,
            decode_speedup=decode_speedup,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    say = None if as_json else (lambda m: typer.echo(f"  simulating {m} ...", err=True))
    result = compare(sc, progress=say)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return
    _print(result)


def _check_numbers(values: dict[str, float], positive: tuple[str, ...]) -> None:
    """Each option finite and >= 0 (> 0 for those in `positive`), else a usage error."""
    for option, v in values.items():
        low = "> 0" if option in positive else ">= 0"
        if not math.isfinite(v) or v < 0 or (option in positive and v == 0):
            raise typer.BadParameter(f"must be a finite number {low}, got {v}",
                                     param_hint=option)


def _workload(
    ledger: Path | None, *, ledger_mean_hours: float, mean_hours: float, p99_hours: float,
    sigma: float, tokens_per_s: float,
) -> WorkloadModel:
    """The sessions to replay: a recorded ledger's, or lognormal (by sigma or p99)."""
    import sqlite3

    from tidal.ledger.types import LedgerError
    from tidal.schedule.workload import EmpiricalWorkload, LognormalWorkload

    if ledger is not None:
        try:
            return EmpiricalWorkload.from_ledger(
                ledger, mean_s=ledger_mean_hours * 3600 if ledger_mean_hours > 0 else None
            )
        except (LedgerError, sqlite3.Error, ValueError) as e:
            raise typer.BadParameter(str(e), param_hint="--ledger") from None
    if p99_hours > 0:
        if p99_hours <= mean_hours:
            raise typer.BadParameter(f"a p99 of {p99_hours} h must be above --mean-hours "
                                     f"{mean_hours}", param_hint="--p99-hours")
        try:
            return LognormalWorkload.from_p99(
                mean_hours * 3600, p99_hours * 3600, tokens_per_s=tokens_per_s
            )
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--p99-hours") from None
    return LognormalWorkload(mean_s=mean_hours * 3600, sigma=sigma, tokens_per_s=tokens_per_s)


def _print(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=None if Console().is_terminal else 110)
    w = r["workload"]
    sc = r["scenario"]
    con.print(
        f"[bold]{sc['n_devices']} devices[/] x {sc['slots_per_device']} slots, batch "
        f"{sc['batch_size']}, {sc['steps']} steps ({sc['target_samples']} samples), "
        f"staleness <= {sc['max_staleness']} ({sc['staleness_rule']})"
    )
    con.print(
        f"workload {w['kind']}: mean {w['mean_s'] / 3600:.2f} h, median "
        f"{w['median_s'] / 3600:.2f} h, p99 {w['p99_s'] / 3600:.2f} h, "
        f"{w['mean_tokens']:.0f} tokens/session"
        + (f" over the run; {w['summary']}" if w["kind"] == "drifting" else "")
    )
    if sc.get("decode_speedup"):
        con.print(f"decode speedup {sc['decode_speedup']:g}: a lone session on a device runs "
                  f"{1 / (1 - sc['decode_speedup'] * (1 - 1 / sc['slots_per_device'])):.2f}x "
                  "its full-load speed")
    t = Table(show_header=True)
    for col in (
        "policy", "samples/h", "util", "time to target", "staleness mean/max",
        "dropped", "switches", "split",
    ):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for name, p in r["policies"].items():
        st = p["staleness"]
        t.add_row(
            name,
            f"{p['samples_per_hour']:.1f}",
            f"{p['utilization']:.1%}",
            f"{p['time_to_target_h']:.1f} h",
            f"{st['mean']:.2f} / {st['max']}",
            str(st["dropped"]),
            str(p["role_switches"]),
            str(p.get("split", "")),
        )
    con.print(t)
    con.print(f"fluid bound (every device busy, no overheads): "
              f"{r['fluid_bound_samples_per_hour']:.1f} samples/h")
    met = r["targets"]["met"]

    def mark(ok: bool) -> str:
        return "[green]met[/]" if ok else "[red]not met[/]"

    con.print(
        f"elastic vs colocated: [bold]{r['speedup_vs_colocated']:.2f}x[/] "
        f"(target 1.85x: {mark(met['speedup_vs_colocated'])})"
    )
    con.print(
        f"elastic vs async (best fixed split): [bold]{r['speedup_vs_async']:.2f}x[/] "
        f"(target 1.78x: {mark(met['speedup_vs_async'])})"
    )
    con.print(
        f"elastic vs async 50/50: {r['speedup_vs_async_50_50']:.2f}x; vs batch-synchronous "
        f"async: {r['speedup_vs_async_batch']:.2f}x"
    )
    util = r["policies"]["elastic"]["utilization"]
    con.print(f"elastic utilisation {util:.1%} (target 90%: {mark(met['utilization'])})")
