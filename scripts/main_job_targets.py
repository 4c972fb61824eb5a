"""Whether main-job runs meet the main job's targets (docs/main_job.md).

``python scripts/main_job_targets.py runs/<name>/report.json ...`` prints, per report and
trained policy, every target of :func:`nemo_orch.eval.main_job_report.targets` with its value,
as a Markdown table, and exits 1 if any is missed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nemo_orch.eval import main_job_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="report.json of a run")
    args = parser.parse_args(argv)
    rows, all_met = [], True
    for path in args.reports:
        report = json.loads(path.read_text())
        for policy in main_job_report.trained(report):
            checked = main_job_report.targets(report, policy)
            all_met &= all(target.met for target in checked)
            if not rows:
                rows += [
                    "| report | policy | " + " | ".join(t.name for t in checked) + " |",
                    "|---|---|" + "---:|" * len(checked),
                ]
            rows.append(
                f"| {path} | {policy} | "
                + " | ".join(f"{t.value:.4g}{'' if t.met else ' (missed)'}" for t in checked)
                + " |"
            )
    print("\n".join(rows))
    print("every target met" if all_met else "targets missed")
    return 0 if all_met else 1


if __name__ == "__main__":
    sys.exit(main())
