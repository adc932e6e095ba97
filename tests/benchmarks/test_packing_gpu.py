"""benchmarks/packing_gpu.py runs end to end on CPU at a tiny size: the flash cells through its CPU stand-in of the
varlen kernel (same signature, sdpa document by document), so the plumbing the GPU run relies on is checked here: the
varlen arguments the model derives, the windows it hands flash, the pairing of a seq2seq's two sides."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def packing_gpu():
    spec = importlib.util.spec_from_file_location("packing_gpu", ROOT / "benchmarks" / "packing_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_flash_cell_passes_or_is_refused_for_a_mask_defined_pattern(tmp_path):
    flags = ["--tiny", "--parts", "exact", "--backends", "flash", "sdpa", "--output-dir", str(tmp_path)]
    assert packing_gpu().main(flags) == 0
    report = json.loads((tmp_path / "packing_gpu_exact_tiny.json").read_text())
    cells = {(cell["backend"], cell["family"], cell["layer_type"]): cell for cell in report["exact"]}
    assert len(cells) == 2 * 3 * 6
    for (backend, _, layer_type), cell in cells.items():
        if backend == "flash" and layer_type in ("strided", "block"):  # patterns flash cannot be told
            assert cell["outcome"] == "refused" and "defined by their mask" in cell["why"]
            continue
        assert cell["outcome"] == "pass", cell
        assert cell["difference"] < 1e-5 < 0.1 < cell["control"]  # the control shows the check can fail
    # The seq2seq decoder's cross-attention is paired document by document under flash too.
    assert cells[("flash", "seq2seq", "full")]["alone_vs_sdpa"] < 1e-5
    text = (tmp_path / "packing_gpu_exact_tiny.md").read_text()
    assert "- command: `python benchmarks/packing_gpu.py --tiny --parts exact" in text
    assert "| flash | seq2seq | sliding | pass |" in text


@pytest.mark.slow
def test_speed_part_reports_every_mode_and_a_failed_run(tmp_path, monkeypatch):
    module = packing_gpu()
    flags = ["--tiny", "--parts", "speed", "--families", "encoder", "decoder", "--output-dir", str(tmp_path)]
    original = module._packing_benchmark

    def failing_decoder():
        benchmark = original()
        family_section = benchmark.family_section

        def section(family, *args):
            if family == "decoder":
                raise ValueError("eval result 'loss' must be a finite number, got nan.")
            return family_section(family, *args)

        benchmark.family_section = section
        return benchmark

    monkeypatch.setattr(module, "_packing_benchmark", failing_decoder)
    assert module.main(flags) == 0
    report = json.loads((tmp_path / "packing_gpu_speed_tiny.json").read_text())
    encoder, decoder = report["speed"]
    assert [row["packing"] for row in encoder["results"]] == ["padded", "packed"]
    assert decoder["failed"].startswith("eval result 'loss' must be a finite number")
    text = (tmp_path / "packing_gpu_speed_tiny.md").read_text()
    assert "## Training speed, decoder, documents: lines: failed" in text
