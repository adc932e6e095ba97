"""mkdocs hook: the measured numbers come from benchmarks/results/, never from the pages' own text.

Two things, both at build time and offline:

- every file of benchmarks/results/ that is not Markdown (json, png) is published under the site's `results/`, so
  a page links a results file or shows its plot from there and a re-measured file needs no page edit;
- a page line `<!-- results-table: NAME.json -->` is replaced by a Markdown table generated from that file: the
  rows of a compare.py file (benchmark, unit, transformers, coreformer, speedup) or the cells of a long_context.py
  file (type x length: seconds / peak MiB, and the associative-recall accuracy per type), headed by the machine
  the file names and the label saying how the run was taken.

Markdown results files are included with pymdownx.snippets (`--8<-- "benchmarks/results/NAME.md"`), not here.
"""

import json
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MARKER = re.compile(r"^<!-- results-table: (?P<name>[\w.-]+\.json) -->$", re.MULTILINE)


def on_files(files: Files, config) -> Files:
    for path in sorted(RESULTS.glob("*")):
        if path.suffix in (".json", ".png"):
            files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    to_root = "../" * page.file.src_uri.count("/")  # links are relative to the page's own folder
    return MARKER.sub(lambda match: results_table(match["name"], f"{to_root}results"), markdown)


def results_table(name: str, results_url: str = "results") -> str:
    """The Markdown table of one results file; an unknown layout fails the build, naming the file."""
    path = RESULTS / name
    if not path.is_file():
        raise FileNotFoundError(f"results-table: no file benchmarks/results/{name}")
    data = json.loads(path.read_text())
    if "rows" in data:
        table = compare_table(data["rows"])
    elif "results" in data:
        table = long_context_table(data["results"]) + recall_table(data.get("recall_accuracy") or {})
    else:
        raise ValueError(f"results-table: benchmarks/results/{name} holds neither `rows` nor `results`")
    source = f"[`{name}`]({results_url}/{name})"
    label = f" ({data['label']})" if data.get("label") else ""
    measured = f" Date: {data['date']}." if data.get("date") else ""
    measured += f" Command: `{data['command']}`." if data.get("command") else ""
    return f"Machine: {data.get('machine', 'not recorded')}{label}.{measured} Generated from {source}.\n\n{table}\n"


def compare_table(rows: list[dict]) -> str:
    header = "| benchmark | unit | transformers | coreformer | speedup | peak MiB (transformers / coreformer) |"
    lines = [header, "|---|---|---|---|---|---|"]
    for row in rows:
        if "speedup" not in row:
            continue
        peaks = (row.get("reference_peak_mib"), row.get("coreformer_peak_mib"))
        memory = f"{peaks[0]:,.0f} / {peaks[1]:,.0f}" if None not in peaks else "—"
        lines.append(
            f"| {row['benchmark']} | {row['unit']} | {row['reference_per_s']:,.0f} | {row['coreformer_per_s']:,.0f} "
            f"| {row['speedup']:.2f}x | {memory} |"
        )
    return "\n".join(lines)


def long_context_table(results: list[dict]) -> str:
    lengths = sorted({cell["length"] for cell in results})
    types = list(dict.fromkeys(cell["type"] for cell in results))
    cells = {(cell["type"], cell["length"]): cell for cell in results}
    lines = ["| type | " + " | ".join(f"L={length}" for length in lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for kind in types:
        row = [format_cell(cells.get((kind, length))) for length in lengths]
        lines.append(f"| {kind} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def recall_table(accuracy: dict[str, float]) -> str:
    """The associative-recall probe's accuracy per type, when the run measured it."""
    if not accuracy:
        return ""
    rows = "\n".join(f"| {kind} | {value:.3f} |" for kind, value in accuracy.items())
    heading = "Associative recall (`coreformer.probes`), accuracy per type:"
    return f"\n\n{heading}\n\n| type | accuracy |\n|---|---|\n{rows}"


def format_cell(cell: dict | None) -> str:
    if cell is None or cell.get("seconds") is None:
        return "—"
    peak = cell.get("peak_mib")
    return f"{cell['seconds']:.3f} s" + (f" / {peak:.0f} MiB" if peak is not None else "")
