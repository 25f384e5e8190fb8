"""``make bench``: the benchmarks of issues 2, 3 and 5 (see bench/README.md), in one run.

Section 1, admission (issue 2), one after another: (a) runstile's POST /v1/runs,
(b) a minimal durable Flask+SQLite baseline under the same gunicorn setup, (c) the raw
SQLite durable-commit rate, (d) the Flask no-op ceiling (the same setup, no SQLite).
Floor: runstile >= 0.8 x baseline, and no failed request.

Section 2, execution (issue 3), one after another: ``runstile up`` end to end, DBOS on
SQLite (as DBOS sets it up, and in WAL mode), bare Dramatiq on Redis, runstile serve +
worker on Redis, bare Dramatiq on RabbitMQ, huey on SQLite.  Runs/s from the first
submission until every run completed, and idle submit -> start latency.  Floor:
runstile >= 1.0 x DBOS on SQLite (the faster DBOS variant).

Section 3, recovery (issue 5): ``runstile recover`` (a real subprocess) on a 100,000-run
ledger with 1,000 runs whose owner died (expired leases), against DBOS's recovery of
1,000 workflows left PENDING by a SIGKILLed application on SQLite (100,000 workflows).
Items/s = 1,000 / the recovery's own seconds.  Floor: runstile >= 10 x DBOS on SQLite
(the faster DBOS variant).

Each section prints one table with ratios measured in this run and saves JSON under
bench/results/.  Then one combined table (bench/summary.py) checks issue 7's targets
(admission >= 1.2 x baseline with p99 <= 1/5 of its, end to end >= 2 x DBOS, recovery
>= 10 x DBOS) and, after
a full run, is written to docs/performance.md with the chart docs/performance.png.  The
exit code is 1 if any floor that ran fails, cannot be measured, or a run is invalid.

Section 4, flow control (issue 16), measured and not asserted: a 400-run backlog of
mixed priorities admitted while every worker thread of ``runstile up`` is held, then
drained; the share of pairs that started in priority order (bench/flow.py).

Section 5, PostgreSQL (bench/postgresql.py), after the others: every target against the
machine's PostgreSQL server, each in a fresh database the bench creates and drops.
``runstile up`` on a PostgreSQL ledger against DBOS on PostgreSQL and Procrastinate,
the same with 1 and 4 worker processes (scaling), and ``runstile serve`` on PostgreSQL
against a bare Flask + one PostgreSQL insert.  Targets: runstile >= 2 x DBOS on
PostgreSQL, >= 1 x Procrastinate, 2 worker processes >= 1.6 x one, admission >= 1 x.

Environment: BENCH_ONLY (admission | execution | recovery | flow | postgresql; all when
unset), BENCH_PG_URL, BENCH_PG_TARGETS,
BENCH_FLOW_RUNS (400), BENCH_SECONDS (10),
BENCH_WARMUP (2), BENCH_CLIENT_PROCESSES (4), BENCH_CLIENT_THREADS (4), BENCH_E2E_RUNS
(2000), BENCH_LATENCY_RUNS (50), BENCH_EXEC_TARGETS, BENCH_RECOVERY_REPEATS (3), ... (all in
bench/README.md);
BENCH_KEEP=1 keeps the temporary data directories.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import sqlite3
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import admission, execution, flow, postgresql, recovery, summary  # noqa: E402

FLOOR = 0.8          # issue 2: runstile >= 0.8 x baseline (b)
EXEC_FLOOR = 1.0     # issue 3: runstile end to end >= 1.0 x DBOS on SQLite
START_AIM_MS = 20.0  # issue 3 aims at an idle submit -> start p50 <= 20 ms
RECOVERY_FLOOR = 10.0  # issue 5: runstile recovery items/s >= 10 x DBOS on SQLite
RESULTS = Path(__file__).resolve().parent / "results"
#: Each section's report from this run, for the combined table (bench/summary.py).
REPORTS: dict[str, dict] = {}


def _http_row(name: str, r: admission.HttpResult) -> dict:
    load = r.load
    return {
        "target": name,
        "throughput_per_s": round(load.throughput, 1),
        "p50_ms": _round(load.percentile_ms(50)),
        "p99_ms": _round(load.percentile_ms(99)),
        "ok": load.ok,
        "sent": load.sent,
        "errors": sum(load.errors.values()),
        "accepted_202": load.accepted,
        "rows_in_db": r.rows_in_db,
        "rows_match_202s": r.rows_match,
        "error_kinds": load.errors,
        "server_cpu_ms_per_req": _round(1000 * r.server_cpu_s / load.ok) if load.ok else None,
        "client_cpu_ms_per_req": _round(1000 * load.client_cpu_s / load.sent) if load.sent else None,
    }


def _round(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def _fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(report: dict) -> None:
    rs, bl, raw = report["runstile"], report["baseline"], report["raw_sqlite"]
    cfg = report["config"]
    print()
    print(f"admission benchmark — {cfg['clients']} clients ({cfg['client_processes']} processes "
          f"x {cfg['client_threads']} threads, HTTP keep-alive), warm-up {cfg['warmup_s']:g} s, "
          f"{cfg['duration_s']:g} s per target, {cfg['cpus']} CPUs")
    header = (f"{'target':<34} {'rate/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'errors':>7} "
              f"{'srv CPU ms/req':>15} {'cli CPU ms/req':>15}")
    print(header)
    print("-" * len(header))
    for label, row in (("(a) runstile POST /v1/runs", rs),
                       ("(b) baseline Flask+SQLite insert", bl)):
        print(f"{label:<34} {row['throughput_per_s']:>9.1f} {_fmt(row['p50_ms'], '.2f'):>8} "
              f"{_fmt(row['p99_ms'], '.2f'):>8} {row['errors']:>7} "
              f"{_fmt(row['server_cpu_ms_per_req'], '.3f'):>15} "
              f"{_fmt(row['client_cpu_ms_per_req'], '.3f'):>15}")
    print(f"{'(c) raw SQLite commits (rows/s)':<34} {raw['rows_per_s']:>9.1f} {'':>8} {'':>8} "
          f"{'':>7} {_fmt(raw['cpu_ms_per_row'], '.3f'):>15}")
    nf = report.get("flask_noop")
    if nf is not None:
        print(f"{'(d) Flask no-op ceiling, no SQLite':<34} {nf['throughput_per_s']:>9.1f} "
              f"{_fmt(nf['p50_ms'], '.2f'):>8} {_fmt(nf['p99_ms'], '.2f'):>8} "
              f"{nf['errors']:>7} {_fmt(nf['server_cpu_ms_per_req'], '.3f'):>15} "
              f"{_fmt(nf['client_cpu_ms_per_req'], '.3f'):>15}")
    print("-" * len(header))
    ratios = report["ratios"]
    print(f"runstile / baseline (throughput)   {_fmt(ratios['runstile_over_baseline'], '.3f')}")
    print(f"runstile / raw SQLite              {_fmt(ratios['runstile_over_raw'], '.3f')}")
    print(f"baseline / raw SQLite              {_fmt(ratios['baseline_over_raw'], '.3f')}")
    print(f"runstile / baseline (p50 latency)  {_fmt(ratios['p50_runstile_over_baseline'], '.3f')}")
    if "runstile_over_flask_noop" in ratios:
        print(f"runstile / Flask no-op ceiling     {_fmt(ratios['runstile_over_flask_noop'], '.3f')}")
        print(f"baseline / Flask no-op ceiling     {_fmt(ratios['baseline_over_flask_noop'], '.3f')}")
    for name, row in (("runstile", rs), ("baseline", bl), ("flask_noop", report.get("flask_noop"))):
        if row and row["errors"]:
            print(f"ERRORS {name}: {row['error_kinds']}")
        if name == "flask_noop":
            continue
        check = "ok" if row["rows_match_202s"] else "MISMATCH"
        print(f"durability check {name}: {row['accepted_202']} x 202 answered, "
              f"{row['rows_in_db']} rows in its database -> {check}")
    floor = report["floor"]
    print(f"floor (issue 2): runstile >= {FLOOR} x baseline: "
          f"{_fmt(ratios['runstile_over_baseline'], '.3f')} -> {floor['verdict']}")
    print(f"saved {report['saved_to']}")


def admission_section() -> bool:
    """Issue 2's benchmark; True when its floor passed on a valid run."""
    cfg = admission.Settings.from_env()
    print(f"bench: {cfg.duration_s:g} s per target after {cfg.warmup_s:g} s warm-up "
          "(override with BENCH_SECONDS / BENCH_WARMUP)", flush=True)
    print("  (a) runstile ...", flush=True)
    rs = admission.bench_runstile(cfg)
    print(f"      {rs.load.throughput:.1f} req/s", flush=True)
    print("  (b) baseline ...", flush=True)
    bl = admission.bench_baseline(cfg)
    print(f"      {bl.load.throughput:.1f} req/s", flush=True)
    print("  (c) raw SQLite ...", flush=True)
    raw = admission.bench_raw(cfg)
    print(f"      {raw['rows_per_s']:.1f} rows/s", flush=True)
    print("  (d) Flask no-op ceiling ...", flush=True)
    nf = admission.bench_flask_noop(cfg)
    print(f"      {nf.load.throughput:.1f} req/s", flush=True)

    rs_row, bl_row = _http_row("runstile", rs), _http_row("baseline", bl)
    nf_row = _http_row("flask_noop", nf)
    ratio = _ratio(rs.load.throughput, bl.load.throughput)
    errors = rs_row["errors"] + bl_row["errors"]     # (d) is a reference, not the floor's
    mismatched = [r["target"] for r in (rs_row, bl_row) if not r["rows_match_202s"]]
    passed = ratio is not None and ratio >= FLOOR
    verdict = "PASS" if passed else "FAIL"
    invalid = []
    if errors:
        invalid.append(f"{errors} failed requests")
    if mismatched:
        invalid.append("rows != 202s for " + ", ".join(mismatched))
    if invalid:
        verdict += " (but INVALID: " + "; ".join(invalid) + ")"
    valid = not invalid
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"admission-{stamp}.json"
    report = {
        "benchmark": "admission (issue 2)",
        "time": stamp,
        "config": {"duration_s": cfg.duration_s, "warmup_s": cfg.warmup_s,
                   "client_processes": cfg.processes, "client_threads": cfg.threads,
                   "clients": cfg.processes * cfg.threads,
                   "server": f"gunicorn {admission.GUNICORN_WORKERS} processes x "
                             f"{admission.GUNICORN_THREADS} gthread threads, C parser",
                   "cpus": os.cpu_count(), "python": platform.python_version(),
                   "sqlite": sqlite3.sqlite_version, "platform": platform.platform()},
        "runstile": rs_row,
        "baseline": bl_row,
        "raw_sqlite": {"target": "raw_sqlite", "rows_per_s": round(raw["rows_per_s"], 1),
                       "rows": raw["rows"], "journal_mode": raw["journal_mode"],
                       "cpu_ms_per_row": _round(1000 * raw["cpu_s"] / raw["rows"], 4)
                       if raw["rows"] else None},
        "ratios": {
            "runstile_over_baseline": ratio,
            "runstile_over_raw": _ratio(rs.load.throughput, raw["rows_per_s"]),
            "baseline_over_raw": _ratio(bl.load.throughput, raw["rows_per_s"]),
            "p50_runstile_over_baseline": _ratio(rs_row["p50_ms"] or 0, bl_row["p50_ms"] or 0),
            "runstile_over_flask_noop": _ratio(rs.load.throughput, nf.load.throughput),
            "baseline_over_flask_noop": _ratio(bl.load.throughput, nf.load.throughput),
        },
        "flask_noop": nf_row,
        "floor": {"rule": f"runstile >= {FLOOR} x baseline", "passed": passed and valid,
                  "verdict": verdict},
        "saved_to": str(out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out),
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "latest.json").write_text(json.dumps(report, indent=2) + "\n")
    REPORTS["admission"] = report
    print_table(report)
    return passed and valid


def main() -> int:
    # A SIGTERM (e.g. from make or CI) unwinds like Ctrl-C so every server is killed.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    only = os.environ.get("BENCH_ONLY", "").strip()
    if only not in ("", "admission", "execution", "recovery", "flow", "postgresql"):
        print("BENCH_ONLY must be 'admission', 'execution', 'recovery', 'flow' or "
              "'postgresql'", file=sys.stderr)
        return 2
    verdicts = {}
    started = summary.now()
    t_start = time.monotonic()
    if only in ("", "admission"):
        print("== admission benchmark (issue 2) ==", flush=True)
        verdicts["admission (issue 2)"] = admission_section()
    if only in ("", "execution"):
        print("\n== execution benchmark (issue 3) ==", flush=True)
        verdicts["execution (issue 3)"] = execution_section()
    if only in ("", "recovery"):
        print("\n== recovery benchmark (issue 5) ==", flush=True)
        verdicts["recovery (issue 5)"] = recovery_section()
    if only in ("", "flow"):
        print("\n== flow control (issue 16) ==", flush=True)
        verdicts["flow control (issue 16)"] = flow_section()
    if only in ("", "postgresql"):
        print("\n== PostgreSQL ==", flush=True)
        try:
            verdicts["PostgreSQL"] = postgresql_section()
        except Exception:   # the other sections' tables and JSON are already out
            import traceback
            traceback.print_exc()
            verdicts["PostgreSQL"] = False
    try:
        combined = summary.build(REPORTS)
        summary.print_table(combined)
        if summary.docs_wanted(only):
            for path in summary.write_docs(combined, REPORTS, started,
                                           time.monotonic() - t_start):
                print(f"wrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    except Exception:   # the sections' own tables and JSON are already out
        import traceback
        traceback.print_exc()
        verdicts["combined table (issue 7)"] = False
    print()
    for name, ok in verdicts.items():
        print(f"bench: {name}: {'PASS' if ok else 'NOT PASSED'}")
    return 0 if all(verdicts.values()) else 1


# ------------------------------------------------------------------ execution (issue 3)

EXEC_LABELS = {
    "runstile": "(a) runstile up (HTTP + SQLite ledger)",
    "dbos": "(b) DBOS, SQLite as DBOS sets it",
    "dbos-wal": "(c) DBOS, SQLite WAL sync=FULL",
    "dramatiq-redis": "(d) Dramatiq + Redis (not durable)",
    "runstile-redis": "(e) runstile serve+worker, Redis",
    "dramatiq-rabbitmq": "(f) Dramatiq + RabbitMQ (no record)",
    "huey-sqlite": "(g) huey, SqliteHuey as shipped",
}
#: Runs/s ratio keys: runstile (embedded) over each other target.
EXEC_RATIO_KEYS = {name: "runstile_over_" + name.replace("-", "_")
                   for name in EXEC_LABELS if name != "runstile"}


def _exec_row(r: execution.TargetResult) -> dict:
    pct = execution.percentile
    return {
        "target": r.name,
        "measured": r.measured,
        "valid": r.valid,
        "problem": r.reason,
        "runs": r.runs,
        "accepted": r.accepted,
        "completed": r.completed,
        "errors": sum(r.errors.values()),
        "error_kinds": r.errors,
        "runs_per_s": _round(r.runs_per_s, 1),
        "submit_per_s": _round(r.submit_per_s, 1),
        "seconds_to_all_completed": _round(r.total_s, 3),
        "start_p50_ms": _round(pct(r.latencies_ms, 50)),
        "start_p95_ms": _round(pct(r.latencies_ms, 95)),
        "start_max_ms": _round(max(r.latencies_ms) if r.latencies_ms else None),
        "latency_samples": len(r.latencies_ms),
        "latency_missing": r.latency_missing,
        "ledger_start_p50_ms": _round(pct(r.ledger_latency_ms, 50)),
        "ledger_start_p95_ms": _round(pct(r.ledger_latency_ms, 95)),
        "server_cpu_ms_per_run": _round(1000 * r.server_cpu_s / r.completed)
        if r.server_cpu_s is not None and r.completed else None,
        "config": r.config,
    }


def print_exec_table(report: dict) -> None:
    cfg = report["config"]
    rows = {row["target"]: row for row in report["targets"]}
    print()
    print(f"execution benchmark — {cfg['runs']} no-op runs per target from {cfg['clients']} "
          f"closed-loop clients ({cfg['client_processes']} processes x "
          f"{cfg['client_threads']} threads); workers {cfg['workers']}; idle start latency "
          f"over {cfg['latency_runs']} sequential runs {cfg['latency_gap_ms']:g} ms apart; "
          f"{cfg['cpus']} CPUs")
    header = (f"{'target':<38} {'runs/s':>8} {'submit/s':>9} {'start p50 ms':>13} "
              f"{'start p95 ms':>13} {'srv CPU ms/run':>15} {'runstile/this':>14}")
    print(header)
    print("-" * len(header))
    ratios = report["ratios"]
    for name, label in EXEC_LABELS.items():
        row = rows.get(name)
        if row is None:
            print(f"{label:<38} {'(skipped: BENCH_EXEC_TARGETS)':>30}")
        elif not row["measured"]:
            print(f"{label:<38} NOT MEASURED: {row['problem']}")
        else:
            vs = "-" if name == "runstile" else _fmt(ratios.get(EXEC_RATIO_KEYS[name]), '.3f')
            print(f"{label:<38} {_fmt(row['runs_per_s']):>8} {_fmt(row['submit_per_s']):>9} "
                  f"{_fmt(row['start_p50_ms'], '.1f'):>13} {_fmt(row['start_p95_ms'], '.1f'):>13} "
                  f"{_fmt(row['server_cpu_ms_per_run'], '.2f'):>15} {vs:>14}")
    print("-" * len(header))
    print("runstile/this: runstile (a) runs/s / this target's runs/s, both from this run")
    for key, label in (("runstile_over_dbos", "runstile / DBOS (runs/s)"),
                       ("runstile_over_dbos_wal", "runstile / DBOS WAL (runs/s)"),
                       ("runstile_over_dramatiq_redis", "runstile / Dramatiq-redis (runs/s)"),
                       ("start_p50_runstile_over_dbos", "runstile / DBOS (start p50)"),
                       ("start_p50_runstile_over_dramatiq_redis",
                        "runstile / Dramatiq-redis (start p50)")):
        print(f"{label:<38} {_fmt(ratios.get(key), '.3f')}")
    rs = rows.get("runstile")
    if rs and rs["measured"]:
        print(f"runstile ledger started_at - created_at: p50 "
              f"{_fmt(rs['ledger_start_p50_ms'], '.1f')} ms, p95 "
              f"{_fmt(rs['ledger_start_p95_ms'], '.1f')} ms (admission commit -> claim)")
    for row in report["targets"]:
        if row["measured"]:
            check = "ok" if row["valid"] else f"INVALID ({row['problem']})"
            print(f"check {row['target']}: {row['completed']} of {row['runs']} runs completed, "
                  f"{row['errors']} failed submissions, {row['latency_samples']} latency "
                  f"samples -> {check}")
    floor, aim = report["floor"], report["aim"]
    print(f"floor (issue 3): {floor['rule']}: {floor['detail']} -> {floor['verdict']}")
    print(f"aim (issue 3): {aim['rule']}: {aim['detail']} -> {aim['verdict']}")
    print(f"saved {report['saved_to']}")


def execution_section() -> bool:
    """Issue 3's benchmark; True when its floor passed on valid, measured runs."""
    cfg = execution.ExecSettings.from_env()
    print(f"bench: {cfg.runs} runs per target, idle latency over {cfg.latency_runs} runs "
          "(override with BENCH_E2E_RUNS / BENCH_LATENCY_RUNS / BENCH_EXEC_TARGETS)",
          flush=True)
    results = execution.run_all(cfg, log=lambda line: print(line, flush=True))
    by_name = {r.name: r for r in results}
    rows = [_exec_row(r) for r in results]

    def rate(name: str) -> float | None:
        r = by_name.get(name)
        return r.runs_per_s if r is not None and r.measured and r.valid else None

    def p50(name: str) -> float | None:
        r = by_name.get(name)
        return execution.percentile(r.latencies_ms, 50) if r is not None and r.measured else None

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    rs = by_name.get("runstile")
    dbos_rates = {n: rate(n) for n in ("dbos", "dbos-wal") if rate(n) is not None}
    rs_rate = rate("runstile")
    rule = f"runstile runs/s >= {EXEC_FLOOR} x DBOS on SQLite (the faster DBOS variant)"
    if rs is None or not rs.measured:
        verdict, detail, passed = "NOT MEASURED", "runstile was not measured" + (
            f" ({rs.reason})" if rs is not None and rs.reason else ""), False
    elif not rs.valid:
        verdict, detail, passed = "FAIL (INVALID)", f"runstile run invalid: {rs.reason}", False
    elif not dbos_rates:
        why = "; ".join(f"{n}: {by_name[n].reason}" for n in ("dbos", "dbos-wal")
                        if n in by_name) or "no DBOS target selected"
        verdict, detail, passed = "NOT MEASURED", f"no valid DBOS measurement ({why})", False
    else:
        best_name = max(dbos_rates, key=dbos_rates.get)
        best = dbos_rates[best_name]
        r = ratio(rs_rate, best)
        passed = r is not None and r >= EXEC_FLOOR
        verdict = "PASS" if passed else "FAIL"
        detail = f"{rs_rate:.1f} / {best:.1f} ({best_name}) = {r:.3f}"
    rs_p50 = p50("runstile")
    aim = {"rule": f"runstile idle start p50 <= {START_AIM_MS:g} ms",
           "detail": f"{rs_p50:.1f} ms" if rs_p50 is not None else "not measured",
           "verdict": "not measured" if rs_p50 is None
           else ("met" if rs_p50 <= START_AIM_MS else "missed (not a floor)")}
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"execution-{stamp}.json"
    report = {
        "benchmark": "execution (issue 3)",
        "time": stamp,
        "config": {"runs": cfg.runs, "latency_runs": cfg.latency_runs,
                   "latency_gap_ms": cfg.latency_gap_s * 1000,
                   "warmup_runs": cfg.warmup_runs,
                   "client_processes": cfg.processes, "client_threads": cfg.threads,
                   "clients": cfg.processes * cfg.threads,
                   "workers": f"{execution.WORKER_PROCESSES} processes x "
                              f"{execution.WORKER_THREADS} threads",
                   "dbos_polling_interval_s": cfg.dbos_poll_s,
                   "huey_polling": {"delay_s": cfg.huey_delay_s,
                                    "max_delay_s": cfg.huey_max_delay_s},
                   "cpus": os.cpu_count(), "python": platform.python_version(),
                   "sqlite": sqlite3.sqlite_version, "platform": platform.platform()},
        "targets": rows,
        "ratios": {
            **{key: ratio(rs_rate, rate(name)) for name, key in EXEC_RATIO_KEYS.items()},
            "start_p50_runstile_over_dbos": ratio(rs_p50, p50("dbos")),
            "start_p50_runstile_over_dramatiq_redis": ratio(rs_p50, p50("dramatiq-redis")),
        },
        "floor": {"rule": rule, "passed": passed, "verdict": verdict, "detail": detail},
        "aim": aim,
        "saved_to": str(out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out),
    }
    text = json.dumps(report, indent=2) + "\n"
    out.write_text(text)
    (RESULTS / "latest-execution.json").write_text(text)
    REPORTS["execution"] = report
    print_exec_table(report)
    return passed


# ------------------------------------------------------------------ recovery (issue 5)

RECOVERY_LABELS = {
    "runstile": "(a) runstile recover (SQLite ledger)",
    "dbos": "(b) DBOS, SQLite as DBOS sets it",
    "dbos-wal": "(c) DBOS, SQLite WAL sync=FULL",
}


def _recovery_row(r: recovery.RecoveryResult) -> dict:
    return {
        "target": r.name,
        "measured": r.measured,
        "valid": r.valid,
        "problem": r.reason,
        "items": r.items,
        "recovery_s": _round(r.recovery_s, 4),
        "items_per_s": _round(r.items_per_s, 1),
        "process_wall_s": _round(r.wall_s, 4),
        "wall_items_per_s": _round(r.wall_items_per_s, 1),
        "setup_s": _round(r.build_s, 1),
        "checks": r.checks,
        "config": r.config,
    }


def print_recovery_table(report: dict) -> None:
    cfg = report["config"]
    rows = {row["target"]: row for row in report["targets"]}
    rs = rows.get("runstile")
    rs_rate = rs["items_per_s"] if rs and rs["measured"] else None
    print()
    print(f"recovery benchmark — {cfg['orphans']} runs / workflows whose owner died, in "
          f"{cfg['runs']} runs / workflows; median of {cfg['repeats']} recoveries per target "
          f"(each on a fresh copy); run ids {cfg.get('run_ids', 'random')}; {cfg['cpus']} CPUs")
    header = (f"{'target':<38} {'items':>6} {'seconds':>9} {'items/s':>9} "
              f"{'runstile/this':>14} {'process wall s':>15} {'wall items/s':>13}")
    print(header)
    print("-" * len(header))
    for name, label in RECOVERY_LABELS.items():
        row = rows.get(name)
        if row is None:
            print(f"{label:<38} {'(skipped: BENCH_RECOVERY_TARGETS)':>30}")
        elif not row["measured"]:
            print(f"{label:<38} NOT MEASURED: {row['problem']}")
        else:
            ratio = None if name == "runstile" else _ratio(rs_rate or 0, row["items_per_s"] or 0)
            print(f"{label:<38} {row['items']:>6} {_fmt(row['recovery_s'], '.3f'):>9} "
                  f"{_fmt(row['items_per_s'], '.0f'):>9} "
                  f"{('-' if name == 'runstile' else _fmt(ratio, '.2f')):>14} "
                  f"{_fmt(row['process_wall_s'], '.2f'):>15} "
                  f"{_fmt(row['wall_items_per_s'], '.0f'):>13}")
    print("-" * len(header))
    print("seconds: runstile = the pass's own duration_s (its JSON report); DBOS = the "
          "_recover_pending_workflows call" + (" (queue thread running)." if any(
              r["config"].get("queue_thread", "").startswith("running")
              for r in report["targets"]) else " (its queue thread held back)."))
    print("process wall s: spawn -> exit of the recovering process (interpreter, imports, "
          "DBOS.launch() included).")
    for key, label in (("runstile_over_dbos", "runstile / DBOS (items/s)"),
                       ("runstile_over_dbos_wal", "runstile / DBOS WAL (items/s)"),
                       ("wall_runstile_over_dbos", "runstile / DBOS (process wall)"),
                       ("wall_runstile_over_dbos_wal", "runstile / DBOS WAL (process wall)")):
        print(f"{label:<38} {_fmt(report['ratios'].get(key), '.2f')}")
    if rs and rs["measured"]:
        led = rs["config"].get("ledger", {})
        print(f"runstile ledger: {led.get('runs_by_status')}, {led.get('events')} events, "
              f"{led.get('idempotency_keys')} idempotency keys, {led.get('dispatches')} "
              f"dispatches, broker messages {led.get('broker_messages_by_state')}, "
              f"{led.get('file_mb')} MB")
        passes = rs["config"].get("passes", [])
        print("runstile passes: " + ", ".join(
            f"{p['duration_s']:.3f} s (wall {p['wall_s']:.2f} s)" for p in passes))
    for name in ("dbos", "dbos-wal"):
        row = rows.get(name)
        if row and row["measured"]:
            sysdb = row["config"].get("system_database", {})
            print(f"{name} system database: {sysdb.get('workflows_by_status')}, "
                  f"{sysdb.get('file_mb')} MB; recoveries: " + ", ".join(
                      f"{r['duration_s']:.3f} s (wall {r['wall_s']:.2f} s)"
                      for r in row["config"].get("recoveries", [])))
    for row in report["targets"]:
        if row["measured"]:
            check = "ok" if row["valid"] else f"INVALID ({row['problem']})"
            what = ("exactly the orphaned runs changed (running -> interrupted, one "
                    "run.interrupted event each), nothing else in the ledger"
                    if row["target"] == "runstile" else
                    "every workflow left PENDING re-enqueued, none left PENDING on the dead "
                    "executor, completed workflows untouched")
            print(f"check {row['target']}: {what} -> {check}")
    if rs and rs["measured"]:
        plans = rs["config"].get("query_plans") or []
        if plans and "in_process_pass_s" in plans[0]:
            print(f"where a pass's time goes, with query plans (one more pass on the same "
                  f"ledger, in this process, every execute timed: "
                  f"{plans[0]['duration_s']:.3f} s):")
            for p in plans[1:]:
                if p["ms"] < 0.5 and not p["plan"]:
                    continue
                print(f"  {p['ms']:>7.1f} ms {p['calls']:>5} x  {p['statement'][:90]}")
                if p["plan"]:
                    print(f"{'':>22}-> {' | '.join(p['plan'])}")
        elif plans:
            print(f"query plans: {plans[0]}")
    floor = report["floor"]
    print(f"floor (issue 5): {floor['rule']}: {floor['detail']} -> {floor['verdict']}")
    print(f"saved {report['saved_to']}")


def recovery_section() -> bool:
    """Issue 5's benchmark; True when its floor passed on valid, measured recoveries."""
    cfg = recovery.RecoverySettings.from_env()
    print(f"bench: {cfg.orphans} orphaned runs in a {cfg.runs}-run ledger, median of "
          f"{cfg.repeats} recoveries per target (override with BENCH_RECOVERY_RUNS / "
          "BENCH_RECOVERY_REPEATS / BENCH_RECOVERY_TARGETS)", flush=True)
    results = recovery.run_all(cfg, log=lambda line: print(line, flush=True))
    by_name = {r.name: r for r in results}
    rows = [_recovery_row(r) for r in results]

    def rate(name: str, wall: bool = False) -> float | None:
        r = by_name.get(name)
        if r is None or not r.measured or not r.valid:
            return None
        return r.wall_items_per_s if wall else r.items_per_s

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    rs = by_name.get("runstile")
    rs_rate = rate("runstile")
    dbos_rates = {n: rate(n) for n in ("dbos", "dbos-wal") if rate(n) is not None}
    rule = (f"runstile recovery items/s >= {RECOVERY_FLOOR:g} x DBOS on SQLite "
            "(the faster DBOS variant)")
    if rs is None or not rs.measured:
        verdict, detail, passed = "NOT MEASURED", "runstile was not measured" + (
            f" ({rs.reason})" if rs is not None and rs.reason else ""), False
    elif not rs.valid:
        verdict, detail, passed = "FAIL (INVALID)", f"runstile run invalid: {rs.reason}", False
    elif not dbos_rates:
        why = "; ".join(f"{n}: {by_name[n].reason}" for n in ("dbos", "dbos-wal")
                        if n in by_name) or "no DBOS target selected"
        verdict, detail, passed = "NOT MEASURED", f"no valid DBOS measurement ({why})", False
    else:
        best_name = max(dbos_rates, key=dbos_rates.get)
        best = dbos_rates[best_name]
        r = ratio(rs_rate, best)
        passed = r is not None and r >= RECOVERY_FLOOR
        verdict = "PASS" if passed else "FAIL"
        detail = f"{rs_rate:.0f} / {best:.0f} ({best_name}) = {r:.2f}"
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"recovery-{stamp}.json"
    report = {
        "benchmark": "recovery (issue 5)",
        "time": stamp,
        "config": {"runs": cfg.runs, "orphans": cfg.orphans, "queued": cfg.queued,
                   "failed": cfg.failed, "completed": cfg.completed, "repeats": cfg.repeats,
                   "run_ids": cfg.ids, "cpus": os.cpu_count(), "python": platform.python_version(),
                   "sqlite": sqlite3.sqlite_version, "platform": platform.platform()},
        "targets": rows,
        "ratios": {
            "runstile_over_dbos": ratio(rs_rate, rate("dbos")),
            "runstile_over_dbos_wal": ratio(rs_rate, rate("dbos-wal")),
            "wall_runstile_over_dbos": ratio(rate("runstile", True), rate("dbos", True)),
            "wall_runstile_over_dbos_wal": ratio(rate("runstile", True), rate("dbos-wal", True)),
        },
        "floor": {"rule": rule, "passed": passed, "verdict": verdict, "detail": detail},
        "saved_to": str(out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out),
    }
    text = json.dumps(report, indent=2) + "\n"
    out.write_text(text)
    (RESULTS / "latest-recovery.json").write_text(text)
    REPORTS["recovery"] = report
    print_recovery_table(report)
    return passed


# ------------------------------------------------------------------ flow control (issue 16)

def flow_section() -> bool:
    """Issue 16's row: priority order under load, measured and not asserted (no floor);
    True when it could be measured."""
    runs = int(os.environ.get("BENCH_FLOW_RUNS", "400"))
    keep = os.environ.get("BENCH_KEEP") == "1"
    print(f"bench: a {runs}-run mixed-priority backlog behind busy workers "
          "(override with BENCH_FLOW_RUNS)", flush=True)
    row = flow.bench_priority_order(runs, keep).row()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"flow-{stamp}.json"
    report = {"benchmark": "flow control (issue 16)", "time": stamp, "targets": [row],
              "config": {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "sqlite": sqlite3.sqlite_version},
              "saved_to": str(out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd())
                              else out)}
    text = json.dumps(report, indent=2) + "\n"
    out.write_text(text)
    (RESULTS / "latest-flow.json").write_text(text)
    REPORTS["flow"] = report
    print()
    print("flow control — priority order under load (measured, no floor)")
    if not row["measured"]:
        print(f"priority-order: NOT MEASURED: {row['problem']}")
        return False
    print(f"{row['runs']} no-op runs, priorities 0-9, admitted while all "
          f"{execution.WORKER_PROCESSES * execution.WORKER_THREADS} threads were held, "
          "then drained:")
    print(f"  pairs of different priority started in priority order: "
          f"{row['pairs_in_order']:.4f} (random order: about 0.5)")
    print(f"  the same without the {row['prefetched']} runs prefetched before the backlog "
          f"was sorted: {_fmt(row['pairs_in_order_after_prefetch'], '.4f')}")
    print(f"  every priority-9 run started before every priority-0 run: "
          f"{row['all_9s_before_all_0s']}")
    print(f"  starts before the first priority-9 start: {row['starts_before_first_9']}")
    print(f"saved {report['saved_to']}")
    return True

# ------------------------------------------------------------------ PostgreSQL

PG_E2E_GOAL = 2.0           # runstile up on PostgreSQL >= 2 x DBOS on PostgreSQL
PG_PROCRASTINATE_GOAL = 1.0  # ... >= 1 x Procrastinate
PG_SCALING_GOAL = 1.6       # 2 worker processes >= 1.6 x one
PG_ADMISSION_GOAL = 1.0     # runstile serve on PostgreSQL >= 1 x Flask + one PG insert
PG_LABELS = {
    "runstile-pg": "(a) runstile up, PostgreSQL ledger",
    "dbos-pg": "(b) DBOS, PostgreSQL system database",
    "procrastinate-pg": "(c) Procrastinate (async no-op task)",
    "runstile-pg-1w": "(d) runstile up, 1 worker process",
    "runstile-pg-4w": "(e) runstile up, 4 worker processes",
    "serve-pg": "(f) runstile serve POST /v1/runs",
    "baseline-pg": "(g) baseline Flask + one PG insert",
    "raw-pg": "(h) raw PostgreSQL commits (rows/s)",
}


def _pg_rows(results: dict) -> tuple[list[dict], dict]:
    """The end-to-end rows (``_exec_row`` shape) and the admission rows of one run;
    a target not measured keeps its reason in ``problem``."""
    e2e, adm = [], {}
    for name, res in results.items():
        if isinstance(res, str):
            row = {"target": name, "measured": False, "valid": False, "problem": res}
        elif isinstance(res, execution.TargetResult):
            row = _exec_row(res)
        elif isinstance(res, admission.HttpResult):
            row = {**_http_row(name, res), "measured": True}
            row["valid"] = row["errors"] == 0 and row["rows_match_202s"]
            row["problem"] = None if row["valid"] else (
                f"{row['errors']} failed requests; {row['accepted_202']} x 202 but "
                f"{row['rows_in_db']} rows")
        else:
            row = {"target": name, "measured": True, "valid": True, "problem": None,
                   "rows_per_s": round(res["rows_per_s"], 1), "rows": res["rows"],
                   "cpu_ms_per_row": _round(1000 * res["cpu_s"] / res["rows"], 4)
                   if res["rows"] else None}
        if name in postgresql.E2E_TARGETS:
            e2e.append(row)
        else:
            adm[name] = row
    return e2e, adm


def _pg_check(rule: str, rows: dict, a: str, b: str, key: str, goal: float) -> dict:
    """Row ``a``'s ``key`` >= goal x row ``b``'s: PASS, FAIL, or NOT MEASURED (with why)."""
    def why(name: str) -> str | None:
        r = rows.get(name)
        # Short: the row itself prints the whole reason.
        if r is None:
            return f"{name} not run (BENCH_PG_TARGETS)"
        if not r["measured"]:
            return f"{name} not measured"
        if not r["valid"]:
            return f"{name} INVALID"
        return None
    missing = [w for w in (why(a), why(b)) if w]
    if missing:
        # As the execution floor does: an invalid runstile run fails; an invalid or
        # missing comparand leaves the target not measured, never passed.
        invalid = missing == [why(a)] and "INVALID" in missing[0]
        return {"rule": rule, "passed": False, "detail": "; ".join(missing), "goal": goal,
                "verdict": "FAIL (INVALID)" if invalid else "NOT MEASURED", "ratio": None}
    ra, rb = rows[a][key], rows[b][key]
    ratio = _ratio(ra or 0, rb or 0)
    passed = ratio is not None and ratio >= goal
    return {"rule": rule, "passed": passed, "ratio": ratio, "goal": goal,
            "detail": f"{ra:.1f} / {rb:.1f} = {_fmt(ratio, '.3f')}",
            "verdict": "PASS" if passed else "FAIL"}


def _pg_checks(e2e: list[dict], adm: dict) -> dict[str, dict]:
    rows = {r["target"]: r for r in e2e}
    return {
        "end to end vs DBOS": _pg_check(
            f"runstile up runs/s >= {PG_E2E_GOAL:g} x DBOS, both on PostgreSQL", rows,
            "runstile-pg", "dbos-pg", "runs_per_s", PG_E2E_GOAL),
        "end to end vs Procrastinate": _pg_check(
            f"runstile up runs/s >= {PG_PROCRASTINATE_GOAL:g} x Procrastinate", rows,
            "runstile-pg", "procrastinate-pg", "runs_per_s", PG_PROCRASTINATE_GOAL),
        "scaling": _pg_check(
            f"runstile up on PostgreSQL, 2 worker processes >= {PG_SCALING_GOAL:g} x 1",
            rows, "runstile-pg", "runstile-pg-1w", "runs_per_s", PG_SCALING_GOAL),
        "admission": _pg_check(
            f"runstile serve req/s >= {PG_ADMISSION_GOAL:g} x bare Flask + one PostgreSQL "
            "insert", adm, "serve-pg", "baseline-pg", "throughput_per_s", PG_ADMISSION_GOAL),
    }


def print_pg_table(report: dict) -> None:
    cfg, srv = report["config"], report["config"]["server"]
    rows = {r["target"]: r for r in report["targets"]}
    adm = report["admission"]
    print()
    print("PostgreSQL benchmark — " + (
        f"PostgreSQL {srv['server_version']} at {srv['url']} (synchronous_commit="
        f"{srv['synchronous_commit']}, fsync={srv['fsync']}), " if srv else "")
        + f"each target in a fresh database; {cfg['runs']} no-op runs per end-to-end "
        f"target from {cfg['clients']} closed-loop clients, workers {cfg['workers']} "
        f"unless named; admission {cfg['admission_s']:g} s per target; {cfg['cpus']} CPUs")
    header = (f"{'target':<38} {'runs/s':>8} {'submit/s':>9} {'start p50 ms':>13} "
              f"{'start p95 ms':>13} {'srv CPU ms/run':>15} {'runstile/this':>14}")
    print(header)
    print("-" * len(header))
    base = rows.get("runstile-pg")
    base_rate = base["runs_per_s"] if base and base["measured"] and base["valid"] else None
    one = rows.get("runstile-pg-1w")
    one_rate = one["runs_per_s"] if one and one["measured"] and one["valid"] else None
    for name in postgresql.E2E_TARGETS:
        row, label = rows.get(name), PG_LABELS[name]
        if row is None:
            print(f"{label:<38} {'(skipped: BENCH_PG_TARGETS)':>30}")
            continue
        if not row["measured"]:
            print(f"{label:<38} not measured: {row['problem']}")
            continue
        ratio = _ratio(base_rate, row["runs_per_s"] or 0) if base_rate else None
        if name.startswith("runstile"):
            vs = "-" if name == "runstile-pg" else f"2w/this {_fmt(ratio, '.2f')}"
        else:
            vs = _fmt(ratio, ".3f")
        print(f"{label:<38} {_fmt(row['runs_per_s']):>8} {_fmt(row['submit_per_s']):>9} "
              f"{_fmt(row['start_p50_ms'], '.1f'):>13} {_fmt(row['start_p95_ms'], '.1f'):>13} "
              f"{_fmt(row['server_cpu_ms_per_run'], '.2f'):>15} {vs:>14}"
              + ("" if row["valid"] else f"  INVALID: {row['problem']}"))
    if one_rate:
        print("scaling, runs/s against 1 worker process: " + ", ".join(
            f"{n} processes {_fmt(_ratio(rows[t]['runs_per_s'] or 0, one_rate), '.2f')}x"
            for t, n in postgresql.RUNSTILE_WORKERS.items()
            if t in rows and rows[t]["measured"] and rows[t]["valid"]))
    print("-" * len(header))
    print(f"{'admission':<38} {'rate/s':>8} {'p50 ms':>9} {'p99 ms':>13} {'errors':>13} "
          f"{'srv CPU ms/req':>15} {'runstile/this':>14}")
    rs_adm = adm.get("serve-pg")
    rs_rate = rs_adm["throughput_per_s"] if rs_adm and rs_adm["measured"] else None
    for name in postgresql.ADMISSION_TARGETS:
        row, label = adm.get(name), PG_LABELS[name]
        if row is None:
            print(f"{label:<38} {'(skipped: BENCH_PG_TARGETS)':>30}")
        elif not row["measured"]:
            print(f"{label:<38} not measured: {row['problem']}")
        elif name == "raw-pg":
            ratio = _ratio(rs_rate, row["rows_per_s"]) if rs_rate else None
            print(f"{label:<38} {_fmt(row['rows_per_s']):>8} {'':>9} {'':>13} {'':>13} "
                  f"{_fmt(row['cpu_ms_per_row'], '.3f'):>15} {_fmt(ratio, '.3f'):>14}")
        else:
            ratio = _ratio(rs_rate, row["throughput_per_s"]) if rs_rate else None
            vs = "-" if name == "serve-pg" else _fmt(ratio, ".3f")
            print(f"{label:<38} {_fmt(row['throughput_per_s']):>8} "
                  f"{_fmt(row['p50_ms'], '.2f'):>9} {_fmt(row['p99_ms'], '.2f'):>13} "
                  f"{row['errors']:>13} {_fmt(row['server_cpu_ms_per_req'], '.3f'):>15} "
                  f"{vs:>14}")
            print(f"{'':<38} durability check: {row['accepted_202']} x 202 answered, "
                  f"{row['rows_in_db']} rows in its database -> "
                  f"{'ok' if row['rows_match_202s'] else 'MISMATCH'}")
    print("-" * len(header))
    print("srv CPU: the target's own processes; the PostgreSQL server's CPU is in no row.")
    if base and base["measured"] and base.get("ledger_start_p50_ms") is not None:
        print(f"runstile ledger started_at - created_at: p50 "
              f"{_fmt(base['ledger_start_p50_ms'], '.1f')} ms, p95 "
              f"{_fmt(base['ledger_start_p95_ms'], '.1f')} ms (admission commit -> claim)")
    for row in report["targets"]:
        if row["measured"]:
            check = "ok" if row["valid"] else f"INVALID ({row['problem']})"
            print(f"check {row['target']}: {row['completed']} of {row['runs']} runs completed, "
                  f"{row['errors']} failed submissions -> {check}")
    for name, c in report["checks"].items():
        print(f"target (PostgreSQL, {name}): {c['rule']}: {c['detail']} -> {c['verdict']}")
    print(f"saved {report['saved_to']}")


def postgresql_section() -> bool:
    """The PostgreSQL rows; True when every one of their targets passed."""
    cfg = postgresql.PgSettings.from_env()
    print(f"bench: targets {', '.join(cfg.targets)} on {postgresql.redact_url(cfg.admin_url)}; "
          f"{cfg.exec.runs} runs per end-to-end target, {cfg.adm.duration_s:g} s per "
          "admission target (override with BENCH_PG_URL / BENCH_PG_TARGETS / BENCH_E2E_RUNS "
          "/ BENCH_SECONDS)", flush=True)
    info, results = postgresql.run_all(cfg, log=lambda line: print(line, flush=True))
    e2e, adm = _pg_rows(results)
    checks = _pg_checks(e2e, adm)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"postgresql-{stamp}.json"
    report = {
        "benchmark": "postgresql",
        "time": stamp,
        "config": {"runs": cfg.exec.runs, "latency_runs": cfg.exec.latency_runs,
                   "latency_gap_ms": cfg.exec.latency_gap_s * 1000,
                   "clients": cfg.exec.processes * cfg.exec.threads,
                   "client_processes": cfg.exec.processes, "client_threads": cfg.exec.threads,
                   "workers": f"{execution.WORKER_PROCESSES} processes x "
                              f"{execution.WORKER_THREADS} threads",
                   "admission_s": cfg.adm.duration_s, "admission_warmup_s": cfg.adm.warmup_s,
                   "admission_clients": cfg.adm.processes * cfg.adm.threads,
                   "admission_server": f"gunicorn {admission.GUNICORN_WORKERS} processes x "
                                       f"{admission.GUNICORN_THREADS} gthread threads, C parser",
                   "server": info, "cpus": os.cpu_count(),
                   "python": platform.python_version(), "platform": platform.platform()},
        "targets": e2e,
        "admission": adm,
        "checks": checks,
        "saved_to": str(out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out),
    }
    text = json.dumps(report, indent=2) + "\n"
    out.write_text(text)
    (RESULTS / "latest-postgresql.json").write_text(text)
    REPORTS["postgresql"] = report
    print_pg_table(report)
    return all(c["passed"] for c in checks.values())



if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        sys.exit(130)
