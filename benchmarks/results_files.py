"""What the benchmark scripts share: a sibling script as a module, and the results file each writes.

    sibling(name)                                   benchmarks/NAME.py as a module (its functions reused, not copied)
    write_results(output_dir, name, report, table)  NAME.json (the report) beside NAME.md (its table)
    report_head(args)                               a CPU report's first keys: machine, date, command, note, settings
    results_header(title, report)                   a CPU results file's first lines: title, machine, date, command

The scripts run as `python benchmarks/NAME.py` (this folder first on sys.path) and are loaded by path in the tests
(pyproject's pytest `pythonpath` holds this folder), so both find this module by its name.
"""

import argparse
import datetime
import importlib.util
import json
import platform
from pathlib import Path
from types import ModuleType

import torch

BENCHMARKS = Path(__file__).resolve().parent


def sibling(name: str) -> ModuleType:
    """benchmarks/NAME.py as a fresh module: each caller gets its own, so what one patches stays its own."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_results(output_dir: Path, name: str, report: dict, table: str | None) -> None:
    """The report as NAME.json and, when there is one, its Markdown table as NAME.md."""
    (output_dir / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    if table is not None:
        (output_dir / f"{name}.md").write_text(table)


def report_head(args: argparse.Namespace) -> dict:
    """What every CPU benchmark's report starts with: the machine (platform, processor, torch's threads), the date, the
    command and the run's note (args.command, args.note), and every setting (paths as text)."""
    return {
        "machine": {"platform": platform.platform(), "cpu": platform.processor(), "threads": torch.get_num_threads()},
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": args.command,
        "note": args.note,
        "settings": {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()},
    }


def results_header(title: str, report: dict) -> list[str]:
    """The Markdown lines a CPU benchmark's results file starts with: its title, the machine (platform, threads and the
    run's note on how the machine was), the date and the command."""
    return [
        f"# {title}",
        "",
        f"- machine: {report['machine']['platform']}, {report['machine']['threads']} threads"
        + (f" ({report['note']})" if report["note"] else ""),
        f"- date: {report['date']}",
        f"- command: `{report['command']}`",
    ]
