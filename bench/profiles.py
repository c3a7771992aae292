"""Fit error of each performance profile against the measured tables it was fitted to (`switchyard bench
profiles`): median and p90 absolute % error per table, rows used and excluded. Quick: runs in about a second.
`--refit` also refits the coefficients from the CSVs and prints them next to the stored ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from switchyard.workers.engine.perf_model import find_data_dir, fit_coeffs, table_errors
from switchyard.workers.engine.profiles import PROFILES, load_profile_tables

KNEES = tuple(range(0, 1025, 16))


def evaluate(data_dir: Path, refit: bool = False) -> list[dict]:
    report = []
    for prof in PROFILES.values():
        tables = load_profile_tables(prof, data_dir)
        entry: dict = {
            "profile": prof.name,
            "max_model_len": prof.max_model_len,
            "kv_capacity_tokens": prof.kv_capacity_tokens,
            "coeffs": dataclasses.asdict(prof.coeffs),
            "notes": prof.notes,
            "tables": [],
        }
        if refit:
            entry["refit_coeffs"] = dataclasses.asdict(
                fit_coeffs(tables, prof.model, prof.decode_ctx_floor_ms_per_ktok, KNEES)
            )
        for t in tables:
            med, p90, mx = table_errors(prof, t)
            entry["tables"].append(
                {
                    "table": t.name,
                    "points": len(t.points),
                    "rows_used": t.rows_used,
                    "rows_excluded": t.rows_excluded,
                    "median_abs_pct_err": round(med, 2),
                    "p90_abs_pct_err": round(p90, 2),
                    "max_abs_pct_err": round(mx, 2),
                    "excluded": list(t.excluded),
                }
            )
        report.append(entry)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="switchyard bench profiles", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data-dir", type=Path, default=None, help="shared/data (default: $SWITCHYARD_DATA_DIR or search)"
    )
    ap.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report as JSON")
    ap.add_argument("--refit", action="store_true", help="refit the coefficients from the CSVs and show them")
    args = ap.parse_args(argv)
    data_dir = args.data_dir or find_data_dir()
    if data_dir is None or not data_dir.is_dir():
        print("shared/data not found: set SWITCHYARD_DATA_DIR or pass --data-dir", file=sys.stderr)
        return 2
    report = evaluate(data_dir, args.refit)
    for e in report:
        print(
            f"{e['profile']}: max_model_len={e['max_model_len']} kv_capacity_tokens={e['kv_capacity_tokens']}"
        )
        print(f"  coeffs {e['coeffs']}")
        if "refit_coeffs" in e:
            print(f"  refit  {e['refit_coeffs']}")
        for t in e["tables"]:
            print(
                f"  {t['table']:<45} points={t['points']:<4} rows used={t['rows_used']:<5} "
                f"excluded={t['rows_excluded']:<4} median={t['median_abs_pct_err']:5.1f}%  "
                f"p90={t['p90_abs_pct_err']:5.1f}%  max={t['max_abs_pct_err']:5.1f}%"
            )
            for why in t["excluded"]:
                print(f"      excluded: {why}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
