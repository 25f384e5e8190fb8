"""``make bench``: the admission benchmark of issue 2 (see bench/README.md).

Measures, one after another in the same run: (a) runstile's POST /v1/runs, (b) a minimal
durable Flask+SQLite baseline under the same gunicorn setup, (c) the raw SQLite
durable-commit rate.  Prints one table with ratios, saves it as JSON under
bench/results/, and exits 1 if runstile is below the issue-2 floor (0.8 x baseline) or
if any request failed.

Environment: BENCH_SECONDS (default 10), BENCH_WARMUP (2), BENCH_CLIENT_PROCESSES (4),
BENCH_CLIENT_THREADS (4), BENCH_KEEP=1 keeps the temporary data directories.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import sqlite3
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import admission  # noqa: E402

FLOOR = 0.8          # issue 2: runstile >= 0.8 x baseline (b)
RESULTS = Path(__file__).resolve().parent / "results"


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
    print("-" * len(header))
    ratios = report["ratios"]
    print(f"runstile / baseline (throughput)   {_fmt(ratios['runstile_over_baseline'], '.3f')}")
    print(f"runstile / raw SQLite              {_fmt(ratios['runstile_over_raw'], '.3f')}")
    print(f"baseline / raw SQLite              {_fmt(ratios['baseline_over_raw'], '.3f')}")
    print(f"runstile / baseline (p50 latency)  {_fmt(ratios['p50_runstile_over_baseline'], '.3f')}")
    for name, row in (("runstile", rs), ("baseline", bl)):
        if row["errors"]:
            print(f"ERRORS {name}: {row['error_kinds']}")
        check = "ok" if row["rows_match_202s"] else "MISMATCH"
        print(f"durability check {name}: {row['accepted_202']} x 202 answered, "
              f"{row['rows_in_db']} rows in its database -> {check}")
    floor = report["floor"]
    print(f"floor (issue 2): runstile >= {FLOOR} x baseline: "
          f"{_fmt(ratios['runstile_over_baseline'], '.3f')} -> {floor['verdict']}")
    print(f"saved {report['saved_to']}")


def main() -> int:
    # A SIGTERM (e.g. from make or CI) unwinds like Ctrl-C so every server is killed.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
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

    rs_row, bl_row = _http_row("runstile", rs), _http_row("baseline", bl)
    ratio = _ratio(rs.load.throughput, bl.load.throughput)
    errors = rs_row["errors"] + bl_row["errors"]
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
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"admission-{stamp}.json"
    report = {
        "benchmark": "admission (issue 2)",
        "time": stamp,
        "config": {"duration_s": cfg.duration_s, "warmup_s": cfg.warmup_s,
                   "client_processes": cfg.processes, "client_threads": cfg.threads,
                   "clients": cfg.processes * cfg.threads,
                   "server": f"gunicorn {admission.GUNICORN_WORKERS} processes x "
                             f"{admission.GUNICORN_THREADS} gthread threads",
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
        },
        "floor": {"rule": f"runstile >= {FLOOR} x baseline", "passed": passed and valid,
                  "verdict": verdict},
        "saved_to": str(out.relative_to(Path.cwd()) if out.is_relative_to(Path.cwd()) else out),
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    (RESULTS / "latest.json").write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    return 0 if passed and valid else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        sys.exit(130)
