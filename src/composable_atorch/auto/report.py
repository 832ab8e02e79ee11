"""What a search leaves behind: the trials table, the best plan as JSON, an HTML report.

The table lists every measured plan (throughput, predicted and measured peak memory side by side,
status and reason), then the plans predicted over the memory budget (never run), and counts the
proposals that cost nothing (rejected by compose(), or already measured). The HTML report holds
the same table and optuna's own plotly figures (optimization history, parameter importances,
slices), each skipped with a note when the study has too few trials for it.
"""

from __future__ import annotations

import html
import json
import warnings
from pathlib import Path

from rich.table import Table

from composable_atorch.auto.records import SearchResult
from composable_atorch.core import strategy

MiB = 2**20


def console():
    """A rich console; when output is not a terminal (a log, CI) long lines are written whole (the
    log's reader wraps them), and :func:`show` prints the trials table in plain text."""
    import sys

    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=160, soft_wrap=True)


def _mib(value) -> float | None:
    return None if value is None else round(value / MiB, 2)


def rows(result: SearchResult) -> list[dict]:
    """One dict per measured trial, best first (failed, then predicted over the budget, last)."""
    order = {"ok": 0, "infeasible": 1, "failed": 2}
    measured = sorted(
        result.measured, key=lambda r: (order.get(r.status, 3), -(r.result.samples_per_s or 0) if r.result else 0)
    )
    # a plan skipped as predicted slower may carry a step time and no memory figure (peak_bytes None)
    skipped = sorted(result.skipped, key=lambda r: (r.predicted.peak_bytes or 0) if r.predicted else 0)
    out = []
    for r in measured + skipped:
        res, pred = r.result, r.predicted
        out.append(
            {
                "trial": r.number,
                "plan": r.plan_label,
                "steps": list(r.steps),
                "samples_per_s": None if not res or res.samples_per_s is None else round(res.samples_per_s, 2),
                "tokens_per_s": None if not res or res.tokens_per_s is None else round(res.tokens_per_s, 1),
                "predicted_mib": _mib(pred.peak_bytes) if pred else None,
                "peak_mib": None if not res or res.peak_bytes is None else round(res.peak_bytes / MiB, 2),
                "predicted_step_s": None if not pred or pred.step_time_s is None else round(pred.step_time_s, 4),
                "step_s": None if not res or res.step_time is None else round(res.step_time, 4),
                "step_rel_error": None if not res or res.relative_error is None else round(res.relative_error, 4),
                "status": r.status,
                "reason": r.reason or "",
                "best": result.best is not None and r.number == result.best.number,
            }
        )
    return out


def summary(result: SearchResult) -> dict:
    e = result.enumeration
    return {
        "space": {
            "assignments": e.total,
            "valid_plans": len(e.valid),
            "invalid_assignments": len(e.invalid),
            "duplicate_assignments": e.duplicates,
            "rejected_sub_combinations": len(result.space.rejected),
            "knobs": {k: list(v) for k, v in result.space.options.items()},
            # why a parallel degree (sequence split, experts, hybrid) was not proposed (the axes' candidates)
            "degree_notes": list(result.space.degrees.notes),
        },
        "environment": result.space.env.describe(),
        "memory_limit_mib": None if result.memory_limit is None else round(result.memory_limit / MiB, 2),
        "memory_margin": result.memory_margin,
        "predictions": result.prediction_note,
        "prior": list(result.prior_labels),
        "skipped_by_prediction": len(result.skipped),
        "runs_over_budget": result.over_budget_runs,
        "measured_total": len(result.measured),
        "measured_this_run": result.measured_now,
        "invalid_proposals": result.invalid_proposals,
        "duplicate_proposals": result.duplicate_proposals,
        "dry_runs_on_invalid_plans": result.dry_runs_on_invalid,
        "stopped_by": result.stopped_by,
        "wall_time_s": round(result.wall_time, 1),
        "best_trial": None if result.best is None else result.best.number,
        "best_plan": None if result.best is None else result.best.plan_label,
    }


def table(result: SearchResult) -> Table:
    """The trials table for a rich console."""
    t = Table(title=f"trials ({_title(result)})")
    for col, justify in (
        ("#", "right"),
        ("plan", "left"),
        ("samples/s", "right"),
        ("tokens/s", "right"),
        ("predicted s/step", "right"),
        ("s/step", "right"),
        ("predicted MiB", "right"),
        ("peak MiB", "right"),
        ("status", "left"),
        ("reason", "left"),
    ):
        t.add_column(col, justify=justify, overflow="fold")
    for row in rows(result):
        style = (
            "bold green"
            if row["best"]
            else {"failed": "red", "infeasible": "yellow", "predicted-infeasible": "dim"}.get(row["status"])
        )
        t.add_row(
            str(row["trial"]),
            row["plan"] + ("  ← best" if row["best"] else ""),
            _num(row["samples_per_s"]),
            _num(row["tokens_per_s"], 0),
            _num(row["predicted_step_s"], 4),
            _step(row),
            _num(row["predicted_mib"]),
            _num(row["peak_mib"]),
            row["status"],
            row["reason"],  # whole: the column folds long reasons (a "predicted slower" note is the point)
            style=style,
        )
    return t


def _title(result: SearchResult) -> str:
    s = summary(result)
    budget = "" if s["memory_limit_mib"] is None else f", memory budget {s['memory_limit_mib']} MiB per rank"
    rejected = s["space"]["invalid_assignments"] + s["space"]["rejected_sub_combinations"]
    predicted = (
        ""
        if s["memory_limit_mib"] is None
        else (
            f"; {s['skipped_by_prediction']} predicted over the budget (margin {s['memory_margin']:g}), not run; "
            f"{s['runs_over_budget']} run(s) over the budget anyway"
        )
    )
    return (
        f"{s['measured_total']} measured of {s['space']['valid_plans']} valid plans{budget}{predicted}; {rejected} "
        "invalid "
        f"combinations rejected by compose(); {s['invalid_proposals']} invalid and {s['duplicate_proposals']} "
        "repeated proposals cost no run"
    )


def _num(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _step(row: dict) -> str:
    """The measured seconds per step with the precision of the figure (+- one relative standard error)."""
    if row["step_s"] is None:
        return "-"
    err = row.get("step_rel_error")
    return f"{row['step_s']:.4f}" + ("" if err is None else f" ±{100 * err:.1f}%")


def text_table(result: SearchResult) -> str:
    """The trials table as plain text (logs, files, output that is not a terminal): one line of figures
    per trial, then its whole plan and its whole reason on lines of their own, so nothing is cut or
    folded into a narrow column whatever the plan's length."""
    lines = [
        f"trials ({_title(result)})",
        f"{'#':>4}  {'samples/s':>10} {'predicted s':>11} {'s/step':>14} {'predicted MiB':>13} {'peak MiB':>9}  status",
    ]
    for r in rows(result):
        predicted = f"{_num(r['predicted_step_s'], 4):>11} {_step(r):>14} {_num(r['predicted_mib']):>13}"
        lines.append(
            f"{r['trial']:>4}  {_num(r['samples_per_s']):>10} {predicted} {_num(r['peak_mib']):>9}  "
            f"{r['status']}{'  <- best' if r['best'] else ''}"
        )
        lines.append(f"      plan: {r['plan']}")
        if r["reason"]:
            lines.append(f"      reason: {r['reason']}")
    lines.extend(f"note: {note}" for note in result.space.degrees.notes)
    return "\n".join(lines)


def show(console, result: SearchResult) -> None:
    """Print the trials table: rich's table on a terminal; in a log (not a terminal) the plain
    :func:`text_table`, where rich would fold each plan into a column a few words wide."""
    if console.is_terminal:
        console.print(table(result))
        for note in result.space.degrees.notes:
            console.print(f"note: {note}", markup=False, highlight=False)
    else:
        console.print(text_table(result), markup=False, highlight=False, soft_wrap=True)


def figures(study) -> list[tuple[str, object | None, str]]:
    """optuna's plotly figures for the study: (title, figure or None, note)."""
    from optuna import visualization as vis
    from optuna.trial import TrialState

    out = []
    complete = bool(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
    for title, make in (
        ("optimization history", vis.plot_optimization_history),
        ("parameter importances", vis.plot_param_importances),
        ("slices", vis.plot_slice),
    ):
        if not complete:  # optuna would draw an empty figure and log a warning per plot to the user's console
            out.append((title, None, "not drawn: no trial completed"))
            continue
        try:
            with warnings.catch_warnings(record=True) as caught:  # optuna's caveats go in the report, not the console
                warnings.simplefilter("always")
                fig = make(study)
            out.append((title, fig, "; ".join(str(w.message) for w in caught)))
        except Exception as exc:  # noqa: BLE001 - e.g. too few complete trials for importances
            out.append((title, None, f"not drawn: {type(exc).__name__}: {exc}"))
    return out


def write_html(result: SearchResult, path: str | Path) -> Path:
    path = Path(path)
    parts = [f"<h1>composable_atorch search</h1><p>{html.escape(_title(result))}</p>"]
    parts.append("<pre>" + html.escape(json.dumps(summary(result), indent=2)) + "</pre>")
    head = "".join(
        f"<th>{c}</th>"
        for c in ("#", "plan", "samples/s", "tokens/s", "predicted MiB", "measured peak MiB", "status", "reason")
    )
    bold = ' style="font-weight:bold"'
    body = "".join(
        f"<tr{bold if r['best'] else ''}><td>{r['trial']}</td><td>{html.escape(r['plan'])}</td>"
        f"<td>{_num(r['samples_per_s'])}</td><td>{_num(r['tokens_per_s'], 0)}</td>"
        f"<td>{_num(r['predicted_mib'])}</td><td>{_num(r['peak_mib'])}</td>"
        f"<td>{r['status']}</td><td>{html.escape(r['reason'])}</td></tr>"
        for r in rows(result)
    )
    parts.append(f"<table border=1 cellpadding=4><tr>{head}</tr>{body}</table>")
    if result.best_plan is not None:
        parts.append("<h2>best plan</h2><pre>" + html.escape(result.best_plan.explain()) + "</pre>")
    include_js = True  # the first figure carries plotly.js inline: the report opens offline
    for title, fig, note in figures(result.study):
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if note:
            parts.append(f"<p>{html.escape(note)}</p>")
        if fig is None:
            continue
        parts.append(fig.to_html(full_html=False, include_plotlyjs=include_js))
        include_js = False
    path.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>search report</title></head><body>"
        + "\n".join(parts)
        + "</body></html>"
    )
    return path


def write_all(result: SearchResult, out_dir: str | Path) -> dict[str, Path]:
    """best_plan.json (strategy.dump), trials.json and report.html under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    if result.best_plan is not None:
        written["plan"] = out / "best_plan.json"
        strategy.dump(result.best_plan, written["plan"])
    written["trials"] = out / "trials.json"
    written["trials"].write_text(json.dumps({"summary": summary(result), "trials": rows(result)}, indent=2) + "\n")
    written["report"] = write_html(result, out / "report.html")
    return written
