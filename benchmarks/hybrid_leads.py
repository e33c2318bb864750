"""Does each hybrid beat every member? Test P@1 and PSP@5 of ensembles beside their members', and the smallest lead.

Reads each ensemble's metrics.json and ensemble.json (its members' folders, whose metrics.json give the members'
figures; nothing is predicted again) and prints one Markdown row per ensemble: each member's P@1 / PSP@5, the
ensemble's, and its smallest lead over any member in P@1 or in PSP@5 (xmcbench.fusion.objective, here on the
test set). With two folders of ensembles built from the same members by two versions of xmcbench (`--against`), each
row shows both and the summary pairs them.

    python benchmarks/hybrid_leads.py ENSEMBLES_DIR [--against OTHER_ENSEMBLES_DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from xmcbench.ensemble import read_ensemble
from xmcbench.fusion import objective
from xmcbench.storage import read_json


def figures(directory: Path) -> dict:
    metrics = read_json(directory / "metrics.json", "the test metrics")
    return {"P@1": metrics["P@1"], "PSP@5": metrics["PSP@5"]}


def summary(name: str, leads: list[float]) -> str:
    found = np.asarray(leads)
    return (f"{name}: beats every member in both on {int(np.sum(found > 0))} of {len(found)}; smallest lead mean "
            f"{found.mean():+.2f}, worst {found.min():+.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ensembles", type=Path, help="folder of ensemble folders")
    parser.add_argument("--against", type=Path, help="folder of ensembles of the same names, built another way")
    args = parser.parse_args()
    for folder in (args.ensembles, args.against):
        if folder is not None and not folder.is_dir():
            raise SystemExit(f"{folder} is not a folder; pass the folder that holds the ensemble folders")
    names = sorted(path.name for path in args.ensembles.iterdir() if (path / "metrics.json").is_file())
    if args.against:
        names = [name for name in names if (args.against / name / "metrics.json").is_file()]
    columns = [args.ensembles] + ([args.against] if args.against else [])
    print("| ensemble | members: P@1 / PSP@5 | " + " | ".join(f"{c.name}: P@1 / PSP@5 (smallest lead)" for c in columns)
          + " |")
    print("|---|---|" + "---|" * len(columns))
    leads = {column: [] for column in columns}
    for name in names:
        members = [figures(member.path) for member in read_ensemble(args.ensembles / name).members]
        cells = []
        for column in columns:
            hybrid = figures(column / name)
            leads[column].append(objective(hybrid, members))
            cells.append(f"{hybrid['P@1']:.2f} / {hybrid['PSP@5']:.2f} ({leads[column][-1]:+.2f})")
        shown = ", ".join(f"{member['P@1']:.2f} / {member['PSP@5']:.2f}" for member in members)
        print(f"| {name} | {shown} | " + " | ".join(cells) + " |")
    print()
    for column in columns:
        print(summary(str(column), leads[column]))
    if args.against:
        difference = np.asarray(leads[args.ensembles]) - np.asarray(leads[args.against])
        print(f"{args.ensembles} against {args.against}, pair by pair: {int(np.sum(difference > 0))} higher, "
              f"{int(np.sum(difference < 0))} lower, {int(np.sum(difference == 0))} equal smallest leads")


if __name__ == "__main__":
    main()
