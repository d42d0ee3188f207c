"""Every command and snippet in README.md and docs/*.md runs, or says why it cannot here.

The convention (docs/architecture.md, "Documentation that runs"):

- a fenced block tagged `sh`, `bash` or `shell` holds commands; every line
  runs (a line ending in `\\` continues on the next). A block that cannot run
  on this machine (a GPU, an RDMA NIC, a second host, the suite itself) is
  preceded by the HTML comment `<!-- not run here: <reason> -->`, which a
  reader of the rendered page never sees and which marks every line of that
  block; a single line may still end with `# not run here: <reason>`. Either
  is reported as a skip with its reason, never passed over silently;
- a block tagged `python` is executed as it stands; the python blocks of one
  file run in order in one namespace, so a page may set up in one block what
  the next uses;
- output and other text goes in blocks tagged `text` (or any other tag);
  a fenced block without a tag is refused, since nobody could tell whether it
  should run.

Commands run at small sizes: a benchmark (`pdxfer bench ...`, a script under
`benchmarks/`) gets `--tiny` appended — every one takes it, and it overrides
the sizes the line names — so the whole page runs in seconds. Each command
runs in a scratch directory linking to the checkout, with its own empty
`docs/img/`, so a documented `--plot docs/img/x.png` never overwrites the
committed figure. `pdxfer ...` lines run in this process through
`pdxfer.cli.main` (one torch import for all of them); any other line runs
under `bash` with the test's venv first on PATH. A launcher line
(`python -m examples.launch_pd ...`, `examples.launch_cluster`) runs through
the session's `launcher_run` (tests/conftest.py) in that same environment: a
run the example tests make with the same options is made once and asserted
on by both.

The files are found at collection time, so a page another change adds is
checked without editing this test.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"sh", "bash", "shell"}
PYTHON = {"python", "py"}
NOT_RUN = re.compile(r"#\s*not run here:\s*(?P<reason>\S.*?)\s*$")
# The same mark for a whole block, on the line before its fence (invisible when rendered).
NOT_RUN_BLOCK = re.compile(r"^\s*<!--\s*not run here:\s*(?P<reason>\S.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<tag>[^\s`]*)")
# A command line that joins several commands runs under bash as written.
OPERATORS = {"|", "||", "&", "&&", ";", ">", ">>", "<", "(", ")"}
HOW_TO_MARK = ("If it cannot run on a machine without a GPU, an RDMA NIC or a second host, put "
               "`<!-- not run here: <reason> -->` on the line before its block (or end the line "
               "with `# not run here: <reason>`); if it is slow, give it a small-size flag "
               "(benchmarks get --tiny appended).")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # 1-based line of the first content line
    tag: str
    lines: tuple[str, ...]
    reason: str | None = None  # `<!-- not run here: ... -->` before the fence: every line

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Command:
    doc: Path
    line: int
    text: str  # continuation lines joined
    reason: str | None  # set: not run here

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks(doc: Path) -> list[Block]:
    """Every fenced code block of `doc`, dedented by its fence's indent."""
    out, lines, i = [], doc.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, start = len(m["indent"]), m["fence"], i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        body = tuple(line[indent:] if not indent or line[:indent].isspace() else line.lstrip()
                     for line in lines[start:i])
        before = next((ln for ln in reversed(lines[:start - 1]) if ln.strip()), "")
        mark = NOT_RUN_BLOCK.match(before)
        out.append(Block(doc, start + 1, m["tag"].lower(), body, mark["reason"] if mark else None))
        i += 1
    return out


def commands(block: Block) -> list[Command]:
    """The block's command lines (continuations joined), comments and blank lines dropped."""
    out, pending, first = [], "", 0
    for n, raw in enumerate(block.lines, block.line):
        line = raw.rstrip()
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            first = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        m = NOT_RUN.search(text)
        out.append(Command(block.doc, first, text.strip(), m["reason"] if m else block.reason))
    return out


def _all() -> tuple[list[Block], list[Command], list[Block]]:
    every = [b for doc in DOCS for b in blocks(doc)]
    shell = [c for b in every if b.tag in SHELL for c in commands(b)]
    return every, shell, [b for b in every if b.tag in PYTHON]


BLOCKS, COMMANDS, SNIPPETS = _all()


def _id(cmd: Command) -> str:
    return f"{cmd.where} {' '.join(cmd.text.split(' #')[0].split())[:70]}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkout seen through links, with its own `docs/` (empty `img/`) and this venv."""
    where = tmp_path_factory.mktemp("docs-run")
    for entry in ROOT.iterdir():
        if entry.name not in ("docs", ".venv", ".git"):
            (where / entry.name).symlink_to(entry)
    (where / ".venv").symlink_to(Path(sys.prefix))
    (where / "docs" / "img").mkdir(parents=True)
    for page in (ROOT / "docs").iterdir():
        if page.name != "img":
            (where / "docs" / page.name).symlink_to(page)
    return where


def _tokens(text: str) -> list[str] | None:
    """The words of a simple command (comments dropped), or None when it joins several."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words = list(lexer)
    return None if any(w in OPERATORS for w in words) else words


def _split(words: list[str]) -> tuple[list[str], list[str], list[str]]:
    """`(environment assignments, the program and its leading words, its arguments)`.

    The program is `pdxfer`, `python -m MODULE` or `python SCRIPT` (any
    interpreter path), or else the first word.
    """
    env = []
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        env.append(words.pop(0))
    if words and Path(words[0]).name in ("python", "python3"):
        lead = 3 if words[1:2] == ["-m"] else 2
        return env, words[:lead], words[lead:]
    return env, words[:1], words[1:]


def _is_pdxfer(program: list[str]) -> bool:
    return Path(program[0]).name == "pdxfer" or program[1:] == ["-m", "pdxfer"]


def _is_bench(program: list[str], args: list[str]) -> bool:
    """`pdxfer bench ...` or a script under `benchmarks/`: they take --tiny."""
    if _is_pdxfer(program):
        return args[:1] == ["bench"]
    return len(program) == 2 and program[1].startswith("benchmarks/")


def _in_process(argv: list[str], cwd: Path) -> tuple[int, str]:
    """`pdxfer.cli.main(argv)` with its output captured: (exit status, output)."""
    from pdxfer import cli

    out = io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = cli.main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            out.write(f"{exc.code}\n")
    except Exception:  # noqa: BLE001 — reported as the command's failure, with its traceback
        code = 1
        out.write(traceback.format_exc())
    finally:
        os.chdir(here)
    return code, out.getvalue()


def _in_bash(text: str, cwd: Path) -> tuple[int, str]:
    env = dict(os.environ, PATH=f"{cwd / '.venv' / 'bin'}:{os.environ.get('PATH', '')}")
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", "-c", text], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=110)
    return proc.returncode, proc.stdout + proc.stderr


def _launcher(cmd: Command) -> str | None:
    """The launcher (`examples.launch_*`) a simple, env-free line runs, if any: its runs are
    shared through tests/conftest.py's `launcher_run`."""
    words = None if cmd.reason is not None else _tokens(cmd.text)
    if not words:
        return None
    env, program, _args = _split(words)
    module = program[2] if len(program) == 3 else None
    return module if not env and module and module.startswith("examples.launch_") else None


@pytest.mark.parametrize("cmd", COMMANDS, ids=_id)
def test_documented_command_runs(cmd: Command, scratch: Path, launcher_run) -> None:
    if cmd.reason is not None:
        pytest.skip(f"{cmd.where} `{cmd.text.split('#')[0].strip()}`: not run here: {cmd.reason}")
    words = _tokens(cmd.text)
    if words is None:
        ran = cmd.text
        code, output = _in_bash(ran, scratch)
    else:
        env, program, args = _split(words)
        if _is_bench(program, args):
            args = [*args, "--tiny"]
        if _is_pdxfer(program) and not env:
            ran = shlex.join(["pdxfer", *args])
            code, output = _in_process(args, scratch)
        elif _launcher(cmd):
            ran = shlex.join(["python", "-m", program[2], *args])
            proc = launcher_run(program[2], args)
            code, output = proc.returncode, proc.stdout + proc.stderr
        else:
            ran = shlex.join([*env, *program, *args])
            code, output = _in_bash(ran, scratch)
    assert code == 0, (
        f"{cmd.where}: the documented command `{cmd.text}` failed (ran as `{ran}`, exit "
        f"status {code}). Fix the command or what it documents. {HOW_TO_MARK}\n"
        f"--- its output (last 3000 characters) ---\n{output[-3000:]}")


def test_every_fenced_block_says_what_it_is() -> None:
    untagged = [b.where for b in BLOCKS if not b.tag]
    assert not untagged, (
        f"fenced blocks without a tag at {', '.join(untagged)}: tag commands `sh`, code `python` "
        "(both are run by tests/test_docs.py) and output or anything else `text`")


def test_not_run_lines_give_a_reason() -> None:
    skipped = [c for c in COMMANDS if c.reason is not None]
    vague = [c.where for c in skipped if len(c.reason.split()) < 3]
    assert not vague, f"say why these cannot run here (a few words at least): {vague}"
    assert len(skipped) < len(COMMANDS)  # the convention is to run; a page of skips is a smell


@pytest.mark.parametrize("doc", sorted({b.doc for b in SNIPPETS}), ids=lambda d: str(d.relative_to(ROOT)))
def test_documented_python_runs(doc: Path, scratch: Path) -> None:
    namespace: dict[str, object] = {"__name__": f"docs:{doc.name}"}
    here = os.getcwd()
    os.chdir(scratch)
    try:
        for block in (b for b in SNIPPETS if b.doc == doc):
            # Padded so a traceback names the line of the page itself.
            source = "\n" * (block.line - 1) + "\n".join(block.lines) + "\n"
            try:
                exec(compile(source, str(doc), "exec"), namespace)  # noqa: S102 — the page's own code
            except Exception:  # noqa: BLE001 — reported with the block's place
                pytest.fail(f"{block.where}: the python block starting here raised:\n"
                            f"{traceback.format_exc()}\nEvery python block runs as it stands (the "
                            "blocks of one page share a namespace, in order); put output in a "
                            "`text` block.", pytrace=False)
    finally:
        os.chdir(here)
        for value in namespace.values():  # engines a snippet left open
            close = getattr(value, "close", None)
            if callable(close) and type(value).__module__.startswith("pdxfer"):
                with contextlib.suppress(Exception):
                    close()


# A path in backticks that names a file of this repository (optionally `::a_test_name`).
REPO_PATH = re.compile(r"`((?:README\.md|Makefile|setup\.py|pyproject\.toml|(?:benchmarks|docs|examples|"
                       r"layout|pdxfer|tests|transport)/[\w./-]*))(?:::(\w+))?[`\[]")


# Outputs a documented command writes, named before any run made them.
OUTPUTS = {"docs/gpu-check/"}  # make gpu-check's default GPU_CHECK_OUT


def test_paths_the_docs_name_exist() -> None:
    """`pdxfer/bench/peer.py`, `tests/x.py::test_y`: a reader who follows one finds it.

    Also refuses an absolute path into this machine's workspace: a reader has
    only the repository (cite the source itself, as docs/gpu.md does).
    """
    missing, outside = [], []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            where = f"{doc.relative_to(ROOT)}:{n}"
            if re.search(r"(?<![\w.])/work/", line):
                outside.append(where)
            for path, test in REPO_PATH.findall(line):
                if path in OUTPUTS:
                    continue
                target = ROOT / path.rstrip("/.")
                if not target.exists():
                    missing.append(f"{where} `{path}`")
                elif test and target.is_file() and f"def {test}" not in target.read_text():
                    missing.append(f"{where} `{path}::{test}`")
    assert not outside, f"paths outside the repository at {outside}: cite the source instead"
    assert not missing, "named in the docs but not in the repository: " + "; ".join(missing)


BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def test_only_the_full_size_runs_write_the_committed_figures() -> None:
    """A `--plot` a user copies writes into the current directory, never over `docs/img/`.

    docs/benchmarks.md gives the full-size command that redraws each committed
    figure (tests/pdxfer/test_bench_figures.py checks the figure is that
    command's, run by today's code); a README line that plotted into
    `docs/img/` overwrote a tracked figure with a smoke run.
    """
    plots = [(c, m[1]) for c in COMMANDS for m in re.finditer(r"--plot[ =](\S+)", c.text)]
    assert plots, "no documented --plot: the check below would pass over nothing"
    tracked = [f"{c.where} `{c.text}`" for c, path in plots
               if path.startswith("docs/img/") and c.doc != BENCHMARKS]
    assert not tracked, f"--plot into the committed figures outside docs/benchmarks.md: {tracked}"


# What a reader of the user-facing pages cannot follow: an issue number, a
# helper's branch name (h13b), a commit id. Maintainer pages (architecture,
# reliability) keep theirs as provenance.
INTERNAL = re.compile(r"(?<![\w&])#\d+\b|\bissue \d+|\bh\d+[a-z]?\b|"
                      r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", re.I)


@pytest.mark.parametrize("doc", [ROOT / "README.md", BENCHMARKS], ids=lambda d: d.name)
def test_user_pages_name_no_issue_or_commit(doc: Path) -> None:
    found, fenced = [], False
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            found += [f"{doc.name}:{n} {m[0]!r}" for m in INTERNAL.finditer(line)]
    assert not found, f"say it in plain words instead: {found}"


def test_benchmarks_opens_with_a_summary_that_fits_a_screen() -> None:
    text = BENCHMARKS.read_text()
    sections = re.split(r"^## ", text, flags=re.M)
    assert sections[1].startswith("In one screen\n"), "the first section must be the summary"
    summary = sections[1].splitlines()
    assert len(summary) <= 45, f"the summary is {len(summary)} lines: a screen is ~45"
    headings = {h.strip() for h in re.findall(r"^#{2,4} (.+)$", text, flags=re.M)}
    rows = [r.split("|")[1:-1] for r in summary if r.startswith("| ") and "---" not in r][1:]
    assert rows, "the summary has no table of headline ratios"
    named = [cells[-1].strip() for cells in rows]
    assert all(n == "same" or n in headings for n in named), (
        f"summary rows must name a section of the page: {set(named) - headings - {'same'}}")


def test_a_comment_before_a_block_marks_every_line_not_run(tmp_path: Path) -> None:
    page = tmp_path / "page.md"  # blocks() names places relative to ROOT: not called here
    page.write_text("text\n\n<!-- not run here: needs two hosts for this -->\n\n```sh\n"
                    "pdxfer a\npdxfer b   # a comment\n```\n\n```sh\npdxfer c\n```\n")
    marked, plain = (commands(b) for b in blocks(page))
    assert [(c.text, c.reason) for c in marked] == [
        ("pdxfer a", "needs two hosts for this"), ("pdxfer b   # a comment", "needs two hosts for this")]
    assert [c.reason for c in plain] == [None]  # the mark is the block's, not the page's
