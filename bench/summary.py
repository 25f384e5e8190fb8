"""The combined table of ``make bench`` (issue 7): every section's numbers from one run.

:func:`build` turns the three sections' reports (bench/run.py keeps them in
``run.REPORTS``) into one table of rates, start latencies and ratios, with the issue's
three targets checked where they apply:

* admission: runstile >= 1.2 x the bare Flask + one durable SQLite insert baseline, with
  a p99 latency <= 1/5 of the baseline's (issue 15; issue 2 asked 1.0 x);
* end to end: runstile (embedded) runs/s >= 2 x DBOS on SQLite (the faster of DBOS as
  shipped and DBOS in WAL mode);
* recovery: runstile items/s >= 10 x DBOS on SQLite (the faster variant);
* PostgreSQL (bench/postgresql.py): ``runstile up`` >= 2 x DBOS on PostgreSQL and >= 1 x
  Procrastinate, 2 worker processes >= 1.6 x one, ``runstile serve`` >= 1 x a bare
  Flask + one PostgreSQL insert.

A target whose numbers are missing or whose run is invalid is reported as such, never
as met.  :func:`print_table` prints it; :func:`write_docs` writes docs/performance.md
and the chart docs/performance.png (matplotlib, installed into the venv on demand like
the peers: never a runstile dependency).
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import shlex
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
MATPLOTLIB = "matplotlib==3.11.2"

ADMISSION_TARGET = 1.2     # runstile >= 1.2 x bare Flask + insert (issue 15) ...
ADMISSION_P99_TARGET = 0.2  # ... with a p99 <= 1/5 of the baseline's
E2E_TARGET = 2.0           # runstile runs/s >= 2 x DBOS on SQLite
RECOVERY_TARGET = 10.0     # runstile recovery items/s >= 10 x DBOS on SQLite

EXEC_NAMES = {
    "runstile": "runstile up (embedded SQLite broker)",
    "runstile-redis": "runstile serve + worker, Redis broker",
    "dbos": "DBOS on SQLite, as shipped (rollback journal)",
    "dbos-wal": "DBOS on SQLite, WAL synchronous=FULL",
    "huey-sqlite": "huey SqliteHuey, as shipped (WAL)",
    "dramatiq-redis": "bare Dramatiq on Redis (not durable)",
    "dramatiq-rabbitmq": "bare Dramatiq on RabbitMQ (no record)",
}
PG_E2E_NAMES = {
    "runstile-pg": "runstile up on PostgreSQL (embedded broker)",
    "dbos-pg": "DBOS on PostgreSQL",
    "procrastinate-pg": "Procrastinate on PostgreSQL",
}
PG_SCALING_NAMES = {
    "runstile-pg-1w": "runstile up on PostgreSQL, 1 worker process",
    "runstile-pg": "runstile up on PostgreSQL, 2 worker processes",
    "runstile-pg-4w": "runstile up on PostgreSQL, 4 worker processes",
}
PG_ADMISSION_NAMES = {
    "serve-pg": "runstile serve POST /v1/runs on PostgreSQL",
    "baseline-pg": "bare Flask + one PostgreSQL insert",
}
RECOVERY_NAMES = {
    "runstile": "runstile recover",
    "dbos": "DBOS recovery, SQLite as shipped",
    "dbos-wal": "DBOS recovery, SQLite WAL synchronous=FULL",
}


def _r(x, nd=1):
    return None if x is None else round(x, nd)


def _verdict(ratio: float | None, goal: float, why_missing: str | None) -> tuple[str, bool]:
    if why_missing:
        return f"not measured ({why_missing})", False
    if ratio is None:
        return "not measured", False
    if ratio >= goal:
        return f"met ({ratio:.2f}x >= {goal:g}x)", True
    return f"MISSED ({ratio:.2f}x < {goal:g}x)", False


def _admission_verdict(ratio: float | None, p99_ratio: float | None,
                       why_missing: str | None) -> tuple[str, bool]:
    """Issue 15's admission target: the rate ratio and, beside it, the p99 ratio."""
    if why_missing or ratio is None:
        return _verdict(ratio, ADMISSION_TARGET, why_missing)
    if p99_ratio is None:
        return "not measured (no p99 to compare)", False
    met = ratio >= ADMISSION_TARGET and p99_ratio <= ADMISSION_P99_TARGET
    return (f"{'met' if met else 'MISSED'} ({ratio:.2f}x "
            f"{'>=' if ratio >= ADMISSION_TARGET else '<'} {ADMISSION_TARGET:g}x; p99 "
            f"{p99_ratio:.2f} of the baseline's "
            f"{'<=' if p99_ratio <= ADMISSION_P99_TARGET else '>'} {ADMISSION_P99_TARGET:g})"
            ), met


def _best(rows: dict, names: tuple[str, ...], key: str):
    """(name, value) of the fastest valid, measured row among ``names``."""
    ok = {n: rows[n][key] for n in names
          if n in rows and rows[n].get("measured") and rows[n].get("valid")
          and rows[n].get(key)}
    if not ok:
        return None, None
    name = max(ok, key=ok.get)
    return name, ok[name]


def _against_dbos(rows: dict, key: str, goal: float):
    """runstile's ``key`` rate judged against the faster valid DBOS variant:
    (runstile's rate or None, that DBOS target's name, ratio, verdict, met)."""
    rs = rows.get("runstile")
    rs_rate = rs[key] if rs and rs["measured"] and rs["valid"] else None
    best_name, best = _best(rows, ("dbos", "dbos-wal"), key)
    why = None
    if rs is None or not rs["measured"]:
        why = "runstile: " + ((rs or {}).get("problem") or "not run")
    elif not rs["valid"]:
        why = f"runstile run invalid: {rs['problem']}"
    elif best is None:
        why = "no valid DBOS measurement"
    ratio = round(rs_rate / best, 3) if rs_rate and best else None
    verdict, met = _verdict(ratio, goal, why)
    return rs_rate, best_name, ratio, verdict, met


def build(reports: dict[str, dict]) -> dict:
    rows: list[dict] = []
    targets: list[dict] = []

    def row(section, label, rate=None, unit="", p50=None, p95=None, ratio=None,
            target="", met="", note="", runstile=False, goal_label=""):
        rows.append({"section": section, "target": label, "rate": rate, "unit": unit,
                     "start_p50_ms": p50, "start_p95_ms": p95, "runstile_over_this": ratio,
                     "issue_target": target, "met": met, "note": note, "runstile": runstile,
                     "goal_label": goal_label})

    # ---- admission
    adm = reports.get("admission")
    if adm is None:
        targets.append({"name": "admission", "rule": f"runstile >= {ADMISSION_TARGET:g} x "
                        "bare Flask + one durable SQLite insert",
                        "verdict": "not measured (section not run)", "met": False})
    else:
        rs, bl, raw, nf = (adm["runstile"], adm["baseline"], adm["raw_sqlite"],
                           adm.get("flask_noop"))
        ratios = adm["ratios"]
        invalid = "INVALID" in adm["floor"]["verdict"]
        verdict, met = _admission_verdict(
            ratios["runstile_over_baseline"],
            rs["p99_ms"] / bl["p99_ms"] if rs.get("p99_ms") and bl.get("p99_ms") else None,
            "run invalid: " + adm["floor"]["verdict"] if invalid else None)
        sec = "HTTP admission (POST, 16 clients)"
        row(sec, "runstile POST /v1/runs", rs["throughput_per_s"], "req/s",
            note=f"p50 {rs['p50_ms']} ms, p99 {rs['p99_ms']} ms", runstile=True)
        row(sec, "bare Flask + one durable SQLite insert", bl["throughput_per_s"], "req/s",
            ratio=ratios["runstile_over_baseline"],
            target=f"runstile >= {ADMISSION_TARGET:g}x", met=verdict,
            note=f"p50 {bl['p50_ms']} ms, p99 {bl['p99_ms']} ms")
        if nf is not None:
            row(sec, "Flask no-op ceiling (no SQLite)", nf["throughput_per_s"], "req/s",
                ratio=ratios.get("runstile_over_flask_noop"),
                note=f"p50 {nf['p50_ms']} ms, p99 {nf['p99_ms']} ms; upper bound")
        row("physical reference", "raw SQLite durable commits (1 process)",
            raw["rows_per_s"], "rows/s", ratio=ratios["runstile_over_raw"],
            note="WAL, synchronous=FULL, one row per transaction")
        targets.append({"name": "admission", "rule": f"runstile >= {ADMISSION_TARGET:g} x "
                        "bare Flask + one durable SQLite insert, p99 <= "
                        f"{ADMISSION_P99_TARGET:g} x its", "verdict": verdict,
                        "met": met, "ratio": ratios["runstile_over_baseline"]})

    # ---- execution
    ex = reports.get("execution")
    if ex is None:
        targets.append({"name": "end to end", "rule": f"runstile runs/s >= {E2E_TARGET:g} x "
                        "DBOS on SQLite (the faster DBOS variant)",
                        "verdict": "not measured (section not run)",
                        "met": False})
    else:
        erows = {r["target"]: r for r in ex["targets"]}
        rs_rate, best_name, ratio, verdict, met = _against_dbos(erows, "runs_per_s",
                                                                E2E_TARGET)
        sec = "end to end (no-op runs, 2 x 4 workers)"
        for name, label in EXEC_NAMES.items():
            r = erows.get(name)
            if r is None:
                continue
            if not r["measured"]:
                row(sec, label, note=f"NOT MEASURED: {r['problem']}")
                continue
            is_best = name == best_name
            other_dbos = name in ("dbos", "dbos-wal") and not is_best
            row(sec, label, r["runs_per_s"], "runs/s", r["start_p50_ms"], r["start_p95_ms"],
                ratio=None if name == "runstile" else
                (round(rs_rate / r["runs_per_s"], 3) if rs_rate and r["runs_per_s"] else None),
                target=(f"runstile >= {E2E_TARGET:g}x" if is_best else
                        "(the faster DBOS decides)" if other_dbos else ""),
                met=verdict if is_best else "",
                note="" if r["valid"] else f"INVALID: {r['problem']}",
                runstile=name.startswith("runstile"))
        targets.append({"name": "end to end", "rule": f"runstile runs/s >= {E2E_TARGET:g} x "
                        "DBOS on SQLite (the faster DBOS variant)", "verdict": verdict,
                        "met": met, "ratio": ratio, "against": best_name})

    # ---- recovery
    rec = reports.get("recovery")
    if rec is None:
        targets.append({"name": "recovery", "rule": f"runstile items/s >= "
                        f"{RECOVERY_TARGET:g} x DBOS on SQLite (the faster DBOS variant)",
                        "verdict": "not measured (section not run)", "met": False})
    else:
        rrows = {r["target"]: r for r in rec["targets"]}
        rs_rate, best_name, ratio, verdict, met = _against_dbos(rrows, "items_per_s",
                                                                RECOVERY_TARGET)
        cfg = rec["config"]
        sec = f"recovery ({cfg['orphans']} of {cfg['runs']} items pending)"
        for name, label in RECOVERY_NAMES.items():
            r = rrows.get(name)
            if r is None:
                continue
            if not r["measured"]:
                row(sec, label, note=f"NOT MEASURED: {r['problem']}")
                continue
            is_best = name == best_name
            row(sec, label, r["items_per_s"], "items/s",
                ratio=None if name == "runstile" else
                (round(rs_rate / r["items_per_s"], 3) if rs_rate and r["items_per_s"] else None),
                target=(f"runstile >= {RECOVERY_TARGET:g}x" if is_best else
                        "(the faster DBOS decides)" if name != "runstile" else ""),
                met=verdict if is_best else "",
                note=(f"recovered in {r['recovery_s']:.3f} s" if r["valid"]
                      else f"INVALID: {r['problem']}"),
                runstile=name == "runstile")
        targets.append({"name": "recovery", "rule": f"runstile items/s >= "
                        f"{RECOVERY_TARGET:g} x DBOS on SQLite (the faster DBOS variant)",
                        "verdict": verdict, "met": met, "ratio": ratio,
                        "against": best_name})
    flow = reports.get("flow")
    for r in (flow or {}).get("targets", []):
        # Measured, not a target (issue 16): how closely starts follow priority.
        label = f"runstile up: priority order, {r['runs']}-run backlog"
        if not r["measured"]:
            row("flow control (issue 16)", label, note=f"NOT MEASURED: {r['problem']}")
            continue
        share = r["pairs_in_order"]
        row("flow control (issue 16)", label, None if share is None else round(share * 100, 1),
            "% pairs in order", note=f"all 9s before all 0s: {r['all_9s_before_all_0s']}; "
            f"{r['starts_before_first_9']} starts before the first 9", runstile=True)
    _postgresql(reports.get("postgresql"), row, targets)
    return {"rows": rows, "targets": targets}


def _check_verdict(check: dict) -> tuple[str, bool]:
    """A PostgreSQL target's check (bench/run.py ``_pg_check``) in this table's words."""
    if check["verdict"] in ("PASS", "FAIL"):
        return _verdict(check["ratio"], check["goal"], None)
    if check["verdict"].startswith("FAIL"):
        return f"MISSED ({check['detail']})", False
    return f"not measured ({check['detail']})", False


def _postgresql(pg: dict | None, row, targets: list[dict]) -> None:
    """The PostgreSQL section's rows and its four targets (end to end against DBOS and
    Procrastinate, scaling, admission), each judged by the section's own check."""
    if pg is None:
        targets.append({"name": "PostgreSQL", "rule": "the PostgreSQL section's four "
                        "targets", "verdict": "not measured (section not run)", "met": False})
        return
    checks = pg["checks"]
    verdicts = {name: _check_verdict(c) for name, c in checks.items()}
    erows = {r["target"]: r for r in pg["targets"]}

    def rate(name):
        r = erows.get(name)
        return r["runs_per_s"] if r and r["measured"] and r["valid"] else None

    def e2e_row(sec, name, label, ratio=None, target="", met="", goal_label="", note=""):
        r = erows.get(name)
        if r is None:
            return
        if not r["measured"]:
            row(sec, label, note=f"not measured: {r['problem']}", target=target, met=met,
                runstile=name.startswith("runstile"))
            return
        row(sec, label, r["runs_per_s"], "runs/s", r["start_p50_ms"], r["start_p95_ms"],
            ratio=ratio, target=target, met=met, goal_label=goal_label,
            note=note if r["valid"] else f"INVALID: {r['problem']}",
            runstile=name.startswith("runstile"))

    rs = rate("runstile-pg")
    over = {n: round(rs / rate(n), 3) if rs and rate(n) else None for n in erows}
    sec = "PostgreSQL end to end (no-op runs, 2 x 4 workers)"
    e2e_row(sec, "runstile-pg", PG_E2E_NAMES["runstile-pg"])
    e2e_row(sec, "dbos-pg", PG_E2E_NAMES["dbos-pg"], over.get("dbos-pg"),
            f"runstile >= {checks['end to end vs DBOS']['goal']:g}x",
            verdicts["end to end vs DBOS"][0], "DBOS on PostgreSQL ")
    e2e_row(sec, "procrastinate-pg", PG_E2E_NAMES["procrastinate-pg"],
            over.get("procrastinate-pg"),
            f"runstile >= {checks['end to end vs Procrastinate']['goal']:g}x",
            verdicts["end to end vs Procrastinate"][0], "Procrastinate ")
    sec = "PostgreSQL scaling (runstile up, N worker processes x 4 threads)"
    one = rate("runstile-pg-1w")
    for name, label in PG_SCALING_NAMES.items():
        n = {"runstile-pg-1w": 1, "runstile-pg": 2, "runstile-pg-4w": 4}[name]
        times = f"{rate(name) / one:.2f}x one process" if one and rate(name) else ""
        if name == "runstile-pg-1w":
            e2e_row(sec, name, label, over.get(name),
                    f"2 processes >= {checks['scaling']['goal']:g}x",
                    verdicts["scaling"][0], note="runstile ÷ this = 2 processes ÷ 1")
        else:
            e2e_row(sec, name, label, note=f"{n} processes: {times}" if times else "")
    adm = pg["admission"]
    sec = "PostgreSQL HTTP admission (POST, 16 clients)"
    rs_adm = adm.get("serve-pg")
    rs_rate = rs_adm["throughput_per_s"] if rs_adm and rs_adm.get("measured") else None
    for name, label in {**PG_ADMISSION_NAMES, "raw-pg": "raw PostgreSQL commits "
                        "(1 connection)"}.items():
        r = adm.get(name)
        if r is None:
            continue
        is_bl = name == "baseline-pg"
        target = f"runstile >= {checks['admission']['goal']:g}x" if is_bl else ""
        met = verdicts["admission"][0] if is_bl else ""
        if not r["measured"]:
            row(sec, label, note=f"not measured: {r['problem']}", target=target, met=met,
                runstile=name == "serve-pg")
            continue
        value = r["rows_per_s"] if name == "raw-pg" else r["throughput_per_s"]
        row(sec, label, value, "rows/s" if name == "raw-pg" else "req/s",
            ratio=round(rs_rate / value, 3) if rs_rate and value and name != "serve-pg"
            else None, target=target, met=met, goal_label="Flask + PG insert ",
            note=("one row per autocommitted INSERT; the server's durable-commit rate"
                  if name == "raw-pg" else
                  f"p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms"
                  + ("" if r["valid"] else f"; INVALID: {r['problem']}")),
            runstile=name == "serve-pg")
    for name, c in checks.items():
        verdict, met = verdicts[name]
        targets.append({"name": f"PostgreSQL, {name}", "rule": c["rule"],
                        "verdict": verdict, "met": met, "ratio": c["ratio"]})


# --------------------------------------------------------------------------- output

def _f(x, spec=",.1f"):
    return "-" if x is None else format(x, spec)


def _rate(x):
    if x is None:
        return "-"
    return format(x, ",.0f") if x >= 100 else format(x, ",.1f")


COLUMNS = ("section", "target", "rate", "start p50 ms", "start p95 ms", "runstile ÷ this",
           "issue target", "met?")


def _cells(r: dict) -> list[str]:
    return [r["section"], r["target"] + (f" ({r['note']})" if r["note"] else ""),
            f"{_rate(r['rate'])} {r['unit']}".strip() if r["rate"] is not None else "-",
            _f(r["start_p50_ms"]), _f(r["start_p95_ms"]),
            "-" if r["runstile_over_this"] is None else f"{r['runstile_over_this']:.2f}x",
            r["issue_target"] or "", r["met"] or ""]


def print_table(summary: dict) -> None:
    head = ["target", "rate", "p50 ms", "p95 ms", "runstile/this", "issue target / met?"]
    print()
    print("combined table (issue 7): every number measured in this run")
    print(f"{head[0]:<48} {head[1]:>15} {head[2]:>7} {head[3]:>7} {head[4]:>13}  {head[5]}")
    print("-" * 120)
    section = None
    for r in summary["rows"]:
        if r["section"] != section:
            section = r["section"]
            print(f"[{section}]")
        rate = f"{_rate(r['rate'])} {r['unit']}" if r["rate"] is not None else "-"
        ratio = "-" if r["runstile_over_this"] is None else f"{r['runstile_over_this']:.2f}x"
        goal = f"{r['issue_target']}: {r['met']}" if r["met"] else r["issue_target"]
        print(f"  {r['target'][:46]:<46} {rate:>15} {_f(r['start_p50_ms']):>7} "
              f"{_f(r['start_p95_ms']):>7} {ratio:>13}  {goal}")
        if r["note"]:
            print(f"  {'':<46} {r['note']}")
    print("-" * 120)
    for t in summary["targets"]:
        print(f"issue target, {t['name']}: {t['rule']}: {t['verdict']}")


def markdown_table(summary: dict) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join(["---", "---", "---:", "---:", "---:", "---:", "---", "---"]) + "|"]
    section = None
    for r in summary["rows"]:
        cells = _cells(r)
        if r["runstile"]:
            cells[1] = f"**{cells[1]}**"
            cells[2] = f"**{cells[2]}**"
        if r["met"].startswith("MISSED"):
            cells[7] = f"**{cells[7]}**"
        if r["section"] == section:
            cells[0] = ""
        section = r["section"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def machine() -> dict:
    cpu = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    return {"cpus": os.cpu_count(), "cpu_model": cpu, "memory": mem,
            "machine": platform.machine(), "kernel": platform.release(),
            "python": platform.python_version(), "sqlite": sqlite3.sqlite_version}


def _versions(reports: dict) -> dict:
    from importlib import metadata
    out = {}
    for dist in ("dbos", "huey", "procrastinate", "psycopg", "dramatiq", "pika", "redis",
                 "flask", "gunicorn"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            out[dist] = metadata.version(dist)
    for r in (reports.get("execution") or {}).get("targets", []):
        for key in ("redis_server", "rabbitmq_server"):
            if r.get("config", {}).get(key):
                out[key.replace("_", "-")] = r["config"][key]
    server = ((reports.get("postgresql") or {}).get("config") or {}).get("server") or {}
    if server.get("server_version"):
        out["postgresql-server"] = server["server_version"].split()[0]
    return out


def code_version() -> str:
    """The commit measured, and whether runstile/ or bench/ differed from it."""
    import subprocess
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no",
                                "--", "runstile", "bench"], cwd=REPO, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    if not head:
        return "unknown (no git)"
    return f"`{head}`" + (" with uncommitted changes in runstile/ or bench/" if dirty
                          else " (runstile/ and bench/ as committed)")


def _command() -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
                   if k.startswith("BENCH_") and k != "BENCH_DOCS")
    return (env + " " if env else "") + "make bench"


def ensure_matplotlib() -> str | None:
    from .execution import ensure_package
    return ensure_package("matplotlib", MATPLOTLIB,
                          install=os.environ.get("BENCH_NO_INSTALL") != "1")


def write_chart(summary: dict, path: Path, title: str) -> str | None:
    """The PNG: one panel per measure.  Returns None, or why no chart was drawn."""
    why = ensure_matplotlib()
    if why:
        return why
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pg_rows = [r for r in summary["rows"] if r["section"].startswith("PostgreSQL")]
    rows = [r for r in summary["rows"] if r not in pg_rows]
    panels = [
        ("HTTP admission: requests/s (higher is better)",
         [r for r in rows if r["unit"] in ("req/s", "rows/s")], "rate", False),
        ("end to end: no-op runs/s (higher is better)",
         [r for r in rows if r["unit"] == "runs/s"], "rate", False),
        ("idle submit -> start latency p50 / p95, ms (lower is better)",
         [r for r in rows if r["unit"] == "runs/s"], "latency", False),
        ("recovery: items/s, log scale (higher is better)",
         [r for r in rows if r["unit"] == "items/s"], "rate", True),
        ("PostgreSQL: end to end and scaling, no-op runs/s (higher is better)",
         [r for r in pg_rows if r["unit"] == "runs/s"], "rate", False),
        ("PostgreSQL: HTTP admission requests/s (higher is better)",
         [r for r in pg_rows if r["unit"] in ("req/s", "rows/s")], "rate", False),
    ]
    fig, axes = plt.subplots(3, 2, figsize=(15, 14))
    for ax, (name, prows, kind, log) in zip(axes.flat, panels, strict=False):
        ax.set_title(name, fontsize=10)
        if not prows:
            ax.text(0.5, 0.5, "not measured in this run", ha="center", va="center")
            ax.set_axis_off()
            continue
        labels = [r["target"] for r in prows][::-1]
        ys = range(len(prows))
        colors = ["#1f6fb4" if r["runstile"] else "#9a9a9a" for r in prows][::-1]
        if kind == "latency":
            p50 = [r["start_p50_ms"] or 0 for r in prows][::-1]
            p95 = [r["start_p95_ms"] or 0 for r in prows][::-1]
            ax.barh([y + 0.2 for y in ys], p50, height=0.4, color=colors, label="p50")
            ax.barh([y - 0.2 for y in ys], p95, height=0.4, color=colors, alpha=0.45,
                    label="p95")
            for y, a, b in zip(ys, p50, p95, strict=True):
                ax.text(a, y + 0.2, f" {a:.1f}", va="center", fontsize=8)
                ax.text(b, y - 0.2, f" {b:.1f}", va="center", fontsize=8)
            ax.legend(fontsize=8, loc="lower right")
            ax.set_xlim(0, max(p95 + p50 + [1]) * 1.2)
        else:
            vals = [r["rate"] or 0 for r in prows][::-1]
            ax.barh(list(ys), vals, color=colors)
            for y, v, r in zip(ys, vals, prows[::-1], strict=True):
                extra = "" if r["runstile_over_this"] is None else \
                    f"   (runstile ÷ this {r['runstile_over_this']:.2f}x)"
                ax.text(v, y, f" {v:,.0f}{extra}", va="center", fontsize=8)
            if log:
                ax.set_xscale("log")
                ax.set_xlim(max(1, min(v for v in vals if v > 0) / 3),
                            max(vals) * 12)
            goals = [r for r in prows if r["issue_target"].startswith("runstile >=")
                     and r["rate"]]
            if not log:
                # Wide enough for every target line, not only for the bars.
                ax.set_xlim(0, max([max(vals) * 1.6] + [
                    1.1 * r["rate"] * float(r["issue_target"].split(">=")[1].strip()
                                            .rstrip("x")) for r in goals]))
            for k, r in enumerate(goals):
                goal = float(r["issue_target"].split(">=")[1].strip().rstrip("x"))
                ax.axvline(r["rate"] * goal, color="#c0392b", linestyle="--", linewidth=1)
                x = r["rate"] * goal
                lo, hi = ax.get_xlim()
                frac = ((math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
                        if log else (x - lo) / (hi - lo))
                ax.text(x, 0.01 + 0.07 * k,   # one label above the other
                        f" issue target: runstile >= {goal:g}x "
                        + (r.get("goal_label") or ("Flask + insert " if r["unit"] == "req/s"
                                                   else "the faster DBOS ")),
                        color="#c0392b", fontsize=7.5, va="bottom",
                        ha="right" if frac > 0.55 else "left",
                        transform=ax.get_xaxis_transform(),
                        bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none",
                              "pad": 1})
        ax.set_yticks(list(ys))
        ax.set_yticklabels(labels, fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


HOW_TO_READ = """\
* **Only ratios measured in the same run mean anything.** Clients, servers, workers,
  brokers and the disk all share the same {cpus} CPUs, so every absolute number here is
  this machine's, on this day; the ratios are what carries over. Run-to-run noise on
  this box is 20–30% for end-to-end runs/s, less for admission and recovery, and more
  when anything else is busy.
* **runstile ÷ this** is runstile's rate divided by the row's rate: above 1, runstile
  is faster; below 1, slower. End-to-end ratios use `runstile up` (embedded broker); the
  Redis row is the same ledger with Redis as transport.
* **Durability differs between rows, on purpose.** runstile and DBOS commit every run
  and its outcome to SQLite with `synchronous=FULL` (fsync) and keep the record.
  huey's SqliteHuey commits the queued task the same way, but deletes it when a worker
  takes it and keeps no record of a run that returned None: no idempotency key, lease,
  outcome or recovery of a task whose worker died. Bare Dramatiq keeps no run record at
  all: on Redis (no persistence) it is not durable; on RabbitMQ the message is
  persistent. Those rows show what the ledger costs, not peers to beat, and carry no
  target.
* **The Flask no-op ceiling** answers 202 without touching SQLite under the same
  gunicorn setup: no durable endpoint on this stack can go faster. **Raw SQLite** is
  one process committing one row per transaction: the disk's durable-commit rate.
* **PostgreSQL rows** run against the machine's PostgreSQL server, which is shared: its
  own CPU (the backends doing every commit) is in no row's CPU figure, and anything else
  using it moves those rows. runstile, DBOS and Procrastinate all keep a durable record
  of each run there; Procrastinate has no idempotency key.
* **Start latency** is idle: runs submitted one at a time, 100 ms apart, from the
  client's submit call to the task body's first line (both `time.time()`).
* **Targets.** "met" or "MISSED" is decided on the numbers above, nothing else; a target
  whose numbers are missing or invalid says "not measured", never "met".
"""


def write_docs(summary: dict, reports: dict, started: datetime, seconds: float) -> list[Path]:
    DOCS.mkdir(exist_ok=True)
    m = machine()
    md_path, png_path = DOCS / "performance.md", DOCS / "performance.png"
    title = (f"runstile make bench, {started:%Y-%m-%d %H:%M} UTC, {m['cpus']} CPUs "
             f"{m['machine']}, Python {m['python']}, SQLite {m['sqlite']}")
    chart_problem = write_chart(summary, png_path, title)
    versions = _versions(reports)
    ex = (reports.get("execution") or {}).get("config", {})
    adm = (reports.get("admission") or {}).get("config", {})
    rec = (reports.get("recovery") or {}).get("config", {})
    lines = [
        "# Performance",
        "",
        f"Written by `make bench` (`bench/run.py`) on **{started:%Y-%m-%d} at "
        f"{started:%H:%M} UTC**, from that one run ({seconds / 60:.0f} minutes). Do not edit "
        "the numbers by hand: run the command again. How each section measures is in "
        "`bench/README.md` in the repository.",
        "",
        "## Issue targets",
        "",
    ]
    for t in summary["targets"]:
        lines.append(f"* **{t['name']}**: {t['rule']}: **{t['verdict']}**")
    lines += ["", "## The table", "", markdown_table(summary), ""]
    if chart_problem:
        lines += [f"(No chart: {chart_problem}.)", ""]
    else:
        lines += ["![make bench: admission, end-to-end runs/s, start latency, recovery]"
                  "(performance.png)", ""]
    lines += [
        "## Machine",
        "",
        f"* {m['cpus']} CPUs ({m['cpu_model'] or 'model unknown'}), `uname -m` "
        f"{m['machine']}, Linux {m['kernel']}, {m['memory'] or '? GiB'} memory; "
        "shared with other work, and clients, servers and workers on the same CPUs",
        f"* Python {m['python']}, SQLite {m['sqlite']}",
        f"* code measured: commit {code_version()}",
        "* peers: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        "",
        "## Commands",
        "",
        "```sh",
        _command() + "          # = .venv/bin/python bench/run.py",
        "```",
        "",
    ]
    if adm:
        lines.append(f"* admission: {adm.get('clients')} closed-loop keep-alive clients "
                     f"({adm.get('client_processes')} processes x {adm.get('client_threads')} "
                     f"threads), {adm.get('warmup_s'):g} s warm-up then "
                     f"{adm.get('duration_s'):g} s per target; servers "
                     f"{adm.get('server')}.")
    if ex:
        lines.append(f"* end to end: {ex.get('runs')} no-op runs per target from "
                     f"{ex.get('clients')} closed-loop clients; workers {ex.get('workers')} "
                     f"in every system; start latency over {ex.get('latency_runs')} "
                     f"sequential runs; DBOS queue polling {ex.get('dbos_polling_interval_s')} "
                     f"s; huey consumer polling "
                     f"{(ex.get('huey_polling') or {}).get('delay_s')}–"
                     f"{(ex.get('huey_polling') or {}).get('max_delay_s')} s (its defaults).")
        for r in reports["execution"]["targets"]:
            cmd = r.get("config", {}).get("command")
            if cmd:
                lines.append(f"  * {r['target']}: `{cmd}`")
    if rec:
        lines.append(f"* recovery: {rec.get('orphans')} items whose owner died among "
                     f"{rec.get('runs')}; median of {rec.get('repeats')} recoveries per "
                     "target, each on a fresh copy; `runstile recover --json` against "
                     "`DBOS._recover_pending_workflows`; run ids "
                     f"{_RUN_IDS.get(rec.get('run_ids', 'random'), '?')}.")
    lines += _pg_commands(reports.get("postgresql"))
    lines += ["", "## How to read it", "", HOW_TO_READ.format(cpus=m["cpus"])]
    md_path.write_text("\n".join(lines).rstrip() + "\n")
    return [md_path] + ([] if chart_problem else [png_path])


#: How the recovery section's ledger spells its run ids (BENCH_RECOVERY_IDS).
_RUN_IDS = {"runstile": "as runstile makes them (creation time first, then 80 random bits)",
            "random": "wholly random (as client-supplied ids may be)"}


def _pg_commands(pg: dict | None) -> list[str]:
    """The PostgreSQL section's lines of "Commands"."""
    if not pg:
        return []
    cfg, srv = pg["config"], pg["config"].get("server") or {}
    lines = [f"* PostgreSQL: the machine's server ({srv.get('server_version', '?')}, "
             f"synchronous_commit={srv.get('synchronous_commit', '?')}, "
             f"fsync={srv.get('fsync', '?')}), each target in a fresh database created "
             f"and dropped by the bench; end to end as above ({cfg.get('runs')} runs, "
             f"{cfg.get('clients')} clients); admission as above "
             f"({cfg.get('admission_s'):g} s per target)."]
    for r in pg["targets"]:
        cmd = r.get("config", {}).get("command")
        if cmd:
            lines.append(f"  * {r['target']}: `{cmd}`")
    return lines


def docs_wanted(only: str) -> bool:
    """docs/ is rewritten after a full run (all sections); BENCH_DOCS=1 forces it, 0 stops it."""
    flag = os.environ.get("BENCH_DOCS", "").strip()
    if flag in ("0", "1"):
        return flag == "1"
    return not only


def now() -> datetime:
    return datetime.now(UTC)

