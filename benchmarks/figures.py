"""A benchmark's figures in its docs page's figures file: ``docs/figures/PAGE.md``, one section per benchmark.

Every benchmark that measures a table of a docs page takes ``--markdown FILE``: ``publish`` writes the section
headed by the benchmark's name into FILE (replacing that section where FILE has it, appending it where not, the
other sections left as they are), with the exact command, the conditions it ran under (CPU model and flags,
cores, threads, load average, python, torch and transformers versions, commit) and the table. A re-measurement
therefore edits one section of one file, and the page links to it (``figures/PAGE.md#SECTION``).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


class Tee(io.TextIOBase):
    """Standard output as it is printed, kept: the lines a benchmark prints are the lines it publishes."""

    def __init__(self, out) -> None:
        self.out, self.parts = out, []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def text(self) -> str:
        return "".join(self.parts)

    def block(self) -> str:
        """What was printed, as a markdown code block (for output that is not a markdown table)."""
        return "```\n" + self.text().strip("\n") + "\n```"


@contextlib.contextmanager
def captured() -> Iterator[Tee]:
    """Print as usual, and keep what is printed (``Tee.text``, ``Tee.block``)."""
    tee = Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield tee


def markdown_argument(parser) -> None:
    """The ``--markdown FILE`` option every benchmark that measures a docs table takes."""
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the figures as this benchmark's section of FILE (docs/figures/PAGE.md)",
    )


def load_average() -> str:
    """The 1, 5 and 15 minute load averages (``n/a`` where the OS has none)."""
    try:
        return " / ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def conditions(threads: int | None = None) -> str:
    """What a figure depends on besides the code, as data: the CPU, its flags, the cores this process may use,
    the threads, the load average, and the versions."""
    # Imported here: the compare tool brings matplotlib and hydra, which a benchmark's measuring worker (that
    # imports its script, and so this module) must not carry into the resident set it measures.
    from trainer.tools.compare import machine, versions

    m, v = machine(), versions()
    flags = " ".join(m["cpu_flags"]) or "none of avx2 avx512f avx512_bf16 amx_bf16"
    threads_part = f", {threads} thread(s)" if threads else ""
    return (
        f"{m['cpu']}, flags {flags}, {m['cores']} cores{threads_part}, load average {load_average()}; "
        f"python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, commit {v['git_commit']}"
    )


def command_line(script: str, argv: list[str]) -> str:
    """The command that reproduces a run: the script's path from the repository root and its arguments,
    ``--markdown`` and ``--json`` left out (where the figures go does not change them)."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--markdown", "--json"):
            skip = True
            continue
        if arg.startswith(("--markdown=", "--json=")):
            continue
        args.append(arg)
    rel = Path(script).resolve().relative_to(REPO)
    return shlex.join(["python", str(rel), *args])


def section_text(title: str, command: str, body: str, threads: int | None = None) -> str:
    return f"## {title}\n\n`{command}`: {conditions(threads)}\n\n{body.strip()}\n"


def header(path: Path) -> str:
    """The first lines of a new figures file: whose figures they are and how they are made."""
    return (
        f"# Figures of [{path.stem}.md](../{path.stem}.md)\n\n"
        "Written by the commands each section names (`--markdown` this file); a re-measurement replaces its "
        "section.\n"
    )


def replace_section(text: str, title: str, section: str) -> str:
    """``text`` with its ``## title`` section (up to the next ``## `` heading) replaced by ``section``, or
    ``section`` appended."""
    pattern = re.compile(rf"^## {re.escape(title)}\n.*?(?=^## |\Z)", re.M | re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    return text.rstrip() + "\n\n" + section


def publish(
    path: Path | None,
    title: str,
    body: str,
    threads: int | None = None,
    argv: list[str] | None = None,
    script: str | None = None,
) -> None:
    """Write ``body`` (a markdown table, or lines of a benchmark's output) as the section ``title`` of the
    figures file ``path`` (nothing when ``path`` is None), headed by the command and its conditions."""
    if path is None:
        return
    script = script or sys.argv[0]
    command = command_line(script, sys.argv[1:] if argv is None else argv)
    old = path.read_text() if path.is_file() else header(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(replace_section(old, title, section_text(title, command, body, threads)))
    print(f"figures: section {title!r} of {path}")
