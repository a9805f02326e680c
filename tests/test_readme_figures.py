"""Every figure the README states is in the results file it cites.

The README is read as units: a paragraph, a list item or a table row. A unit cites the files of
`benchmarks/results/` it links to; a table whose rows link to none takes the files of the paragraph
that introduces it. In a unit that cites results files, every number (outside code spans) must be
in one of them: as printed, or rounded to the decimals the README shows (a `.md`'s `.json` twin
counts as part of it); a ratio (1.2x) must be one of the file's ratios: printed with an x, on a
line that names a speed-up, ratio or scaling, or under a JSON key that does. A measured figure (a ratio `1.2x`, a percentage, a time, a rate, a size) in
a unit that cites no results file must be a value of `configs/`. Every cited file must exist.

Nothing here names a row or a file: a new row that links its results file is checked as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
from decimal import Decimal
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results/"
TEXT_SUFFIXES = (".md", ".json", ".log")

# A number as the README prints it: 1.16x, 4,539, 68.8K, 2e-5, 97.85%. Digits glued to a word
# (H100, L0, 1b, sm_90a, 0.5B) are names, not figures.
README_NUMBER = re.compile(r"(?<![\w.])(\d+(?:,\d{3})*(?:\.\d+)?(?:e-\d+)?)(x|K)?(?!\w|\.\d|,\d)")
# What follows a number that makes it a measurement rather than a count or a name.
MEASURE_UNIT = re.compile(r"\s?(%|tok/s|tokens/s|GiB|GB|MiB|MB|ms|us|s\b|nats)")
FILE_NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?")
# Words that make the numbers of a results file's line, or under a JSON key, ratios.
RATIO_WORDS = re.compile(r"speed-?up|ratio|scaling|_vs_|vs_dense|over_|gain", re.IGNORECASE)
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`[^`]*`")


@dataclasses.dataclass(frozen=True)
class Figure:
    text: str  # as printed, suffix or % included
    digits: str  # the number's digits as printed
    value: Decimal  # the number without suffix
    places: int  # decimals shown
    suffix: str  # "x", "K", "%" or ""
    measured: bool  # carries a unit of measurement
    offset: int = 0  # lines after its unit's first


@dataclasses.dataclass
class Unit:
    line: int  # first line in the README, 1-based
    text: str
    cited: list[str]  # repository paths under benchmarks/results/


def _blocks(text: str) -> list[tuple[int, list[str]]]:
    """Blank-line separated blocks outside fenced code, each with its first line number."""
    blocks: list[tuple[int, list[str]]] = []
    current: list[str] = []
    start, fenced = 0, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
            line = ""  # the fence itself ends the block
        if fenced or not line.strip():
            if current:
                blocks.append((start, current))
            current = []
            continue
        if not current:
            start = number
        current.append(line)
    if current:
        blocks.append((start, current))
    return blocks


def cited_files(text: str) -> list[str]:
    return [target.split("#")[0] for _, target in LINK.findall(text) if target.startswith(RESULTS)]


def units(text: str) -> list[Unit]:
    """The README's paragraphs, list items and table rows, each with the results files it cites."""
    found: list[Unit] = []
    introduction: list[str] = []  # files cited by the last paragraph, for a table after it
    for start, lines in _blocks(text):
        if lines[0].startswith("#"):
            introduction = []
            continue
        if all(line.startswith("|") for line in lines):
            for offset, row in enumerate(lines[2:], 2):  # the header and its rule state nothing
                found.append(Unit(start + offset, row, cited_files(row) or introduction))
            continue
        items: list[tuple[int, str]] = []
        for offset, line in enumerate(lines):
            if line.startswith("- ") or not items:
                items.append((start + offset, line))
            else:
                items[-1] = (items[-1][0], items[-1][1] + "\n" + line)
        for line_number, item in items:
            found.append(Unit(line_number, item, cited_files(item)))
        introduction = cited_files(" ".join(lines))
    return found


def figures(unit_text: str) -> list[Figure]:
    """The numbers a unit shows, outside code spans and link targets."""
    # Code spans blanked and links reduced to their text, keeping the line breaks.
    blank = CODE_SPAN.sub(lambda m: "\n" * m.group(0).count("\n") or " ", unit_text)
    visible = LINK.sub(lambda m: m.group(1), blank)
    shown: list[Figure] = []
    spans: list[tuple[int, int]] = []
    for match in README_NUMBER.finditer(visible):
        digits, suffix = match.group(1), match.group(2) or ""
        after = MEASURE_UNIT.match(visible, match.end())
        printed = match.group(0)
        if after and after.group(1) == "%":
            suffix, printed = "%", visible[match.start() : after.end()]
        value = Decimal(digits.replace(",", ""))
        places = max(0, -value.as_tuple().exponent)
        offset = visible.count("\n", 0, match.start())
        shown.append(Figure(printed, digits, value, places, suffix, bool(suffix or after), offset))
        spans.append((match.start(), match.end()))
    # In a range or a list (1.86-1.90x, 702 / 4,539 tok/s) the last number's unit is every number's.
    for i in range(len(shown) - 2, -1, -1):
        between = visible[spans[i][1] : spans[i + 1][0]]
        if shown[i + 1].measured and not shown[i].measured and between.strip() in ("-", "/"):
            shown[i] = dataclasses.replace(shown[i], suffix=shown[i + 1].suffix, measured=True)
    return shown


@dataclasses.dataclass(frozen=True)
class Held:
    """The numbers a results file holds: all of them, and those that are ratios."""

    numbers: tuple[Decimal, ...]
    ratios: tuple[Decimal, ...]

    def __add__(self, other: Held) -> Held:
        return Held(self.numbers + other.numbers, self.ratios + other.ratios)


def _number(text: str) -> Decimal:
    return Decimal(text.replace(",", ""))


def _text_numbers(text: str) -> Held:
    """A number is a ratio where it is printed as one (1.159x) or its line names one (speed-up)."""
    numbers, ratios = [], []
    for line in text.splitlines():
        ratio_line = RATIO_WORDS.search(line) is not None
        for match in FILE_NUMBER.finditer(line):
            numbers.append(_number(match.group(0)))
            if ratio_line or line.startswith("x", match.end()):
                ratios.append(numbers[-1])
    return Held(tuple(numbers), tuple(ratios))


def _json_numbers(node: object, ratio: bool = False) -> Held:
    """A JSON number is a ratio where a key above it names one (train_step_speedup, scaling_fsdp2)."""
    if isinstance(node, dict):
        return sum(
            (_json_numbers(v, ratio or bool(RATIO_WORDS.search(str(k)))) for k, v in node.items()),
            Held((), ()),
        )
    if isinstance(node, list):
        return sum((_json_numbers(v, ratio) for v in node), Held((), ()))
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        value = (Decimal(str(node)),)
        return Held(value, value if ratio else ())
    return Held((), ())


@functools.cache
def file_numbers(root: Path, path: str) -> Held:
    """Every number printed in a results file and in its `.json` twin."""
    file = root / path
    held = Held((), ())
    if file.suffix in (".md", ".log"):
        held += _text_numbers(file.read_text())
    twin = file.with_suffix(".json")
    if twin.exists() and file.suffix in (".md", ".json"):
        held += _json_numbers(json.loads(twin.read_text()))
    return held


def held_for(figure: Figure, root: Path, paths: list[str]) -> tuple[Decimal, ...]:
    """The numbers a figure may be: a ratio (1.2x) only one of the files' ratios."""
    held = [file_numbers(root, path) for path in paths]
    return tuple(n for h in held for n in (h.ratios if figure.suffix == "x" else h.numbers))


@functools.cache
def config_values(root: Path) -> frozenset[Decimal]:
    """Every numeric value in `configs/` (YAML 1.1 reads `2e-5` as a string: parsed here)."""
    values: set[Decimal] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)
        elif isinstance(node, (int, float, str)) and not isinstance(node, bool):
            with contextlib.suppress(ArithmeticError):  # a word, not a number
                values.add(Decimal(str(node)))

    for path in sorted((root / "configs").rglob("*.yaml")):
        walk(yaml.safe_load(path.read_text()))
    return frozenset(v for v in values if v.is_finite())


def matches(figure: Figure, number: Decimal) -> bool:
    """The file's number printed at the README's rounding (in thousands for K, x100 for a %)."""
    half = Decimal(5) * Decimal(10) ** -(figure.places + 1)
    candidates = [number]
    if figure.suffix == "K":
        candidates.append(number / 1000)
    if figure.suffix == "%":
        candidates.append(number * 100)
    return any(abs(c - figure.value) <= half for c in candidates)


def is_config_value(figure: Figure, root: Path) -> bool:
    wanted = figure.value / 100 if figure.suffix == "%" else figure.value
    return figure.suffix != "x" and wanted in config_values(root)


def problems(text: str, root: Path = REPO) -> list[str]:
    """One line per figure or citation of `text` (a README) that its files do not back."""
    found = []
    for unit in units(text):
        missing = [path for path in unit.cited if not (root / path).is_file()]
        found += [f"line {unit.line}: cites {path}, which does not exist" for path in missing]
        readable = [p for p in unit.cited if p not in missing and p.endswith(TEXT_SUFFIXES)]
        for figure in figures(unit.text):
            where = f"line {unit.line + figure.offset}: {figure.text}"
            if is_config_value(figure, root):
                continue
            if readable:
                if not any(matches(figure, n) for n in held_for(figure, root, readable)):
                    found.append(f"{where} is in none of {', '.join(readable)}")
            elif figure.measured and not missing:
                found.append(f"{where} cites no results file and is no config value")
    return found


def readme() -> str:
    return (REPO / "README.md").read_text()


def test_every_readme_figure_is_in_the_file_it_cites():
    assert problems(readme()) == []


def test_the_results_table_cites_a_file_on_every_row():
    text = readme()
    results = text[text.index("## Results") :].split("\n## ")[0]
    rows = [u for u in units(results) if u.text.startswith("|")]
    assert rows, "the README lost its results table"
    assert all(cited_files(row.text) for row in rows), [row.line for row in rows if not cited_files(row.text)]


def _changed(figure: Figure, held: tuple[Decimal, ...]) -> str:
    """The figure changed by a few units of its last place, to a value the cited files do not hold."""
    step = Decimal(10) ** -figure.places
    for bump in range(3, 40):
        value = figure.value + bump * step
        if not any(matches(dataclasses.replace(figure, value=value), n) for n in held):
            return f"{value:.{figure.places}f}{figure.text[len(figure.digits) :]}"
    raise AssertionError(f"no changed value of {figure.text} outside its files")


def test_a_figure_changed_by_hand_fails():
    """In every unit that cites results, change a measured figure by hand: the check names it."""
    text = readme()
    lines = text.splitlines()
    checked = 0
    for unit in units(text):
        readable = [p for p in unit.cited if p.endswith(TEXT_SUFFIXES)]
        measured = [
            f
            for f in figures(unit.text)
            if f.measured
            and not is_config_value(f, REPO)
            and lines[unit.line + f.offset - 1].count(f.text) == 1  # so that one replace() hits it
        ]
        if not readable or not measured:
            continue
        figure = measured[0]
        changed = _changed(figure, held_for(figure, REPO, readable))
        number = unit.line + figure.offset
        line = lines[number - 1]
        edited = [*lines[: number - 1], line.replace(figure.text, changed, 1), *lines[number:]]
        reported = problems("\n".join(edited))
        assert any(p.startswith(f"line {number}: {changed}") for p in reported), (figure.text, changed)
        checked += 1
    assert checked >= 10, checked


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "configs" / "model").mkdir(parents=True)
    (tmp_path / "configs" / "model" / "m.yaml").write_text("ffn_dense_above: 0.03\nl1: 2e-5\n")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "a.md").write_text("| speed-up | 1.159 |\n| tok/s | 68,807 |\n")
    (tmp_path / "benchmarks" / "results" / "a.json").write_text('{"peak_ratio": 0.64391}')
    return tmp_path


LINKED = "[a.md](benchmarks/results/a.md)"


@pytest.mark.parametrize(
    "readme_text",
    [
        f"Step 1.16x dense, 68.8K tok/s, peak 0.644x ({LINKED}).",  # rounded; thousands; JSON twin
        f"| result | file |\n|---|---|\n| 1.159x, 68,807 tokens/s | {LINKED} |",
        f"Measured ({LINKED}):\n\n| x | y |\n|---|---|\n| a | 1.16x |",  # the introduction's file
        "A layer over 3% of H trains dense; lambda `2e-5`, or 2e-5 as a figure.",  # config values
        "Trains in 4 stages on 2 GPUs.",  # counts without a unit cite nothing
    ],
)
def test_figures_backed_by_their_files_pass(project: Path, readme_text: str):
    assert problems(readme_text, project) == []


@pytest.mark.parametrize(
    ("readme_text", "reported"),
    [
        (f"Step 1.26x dense ({LINKED}).", "line 1: 1.26x is in none of benchmarks/results/a.md"),
        (f"Step 1.2x dense, 68.9K ({LINKED}).", "line 1: 68.9K is in none"),
        (f"| r | f |\n|---|---|\n| 1.16x | {LINKED} |\n| 1.17x | {LINKED} |", "line 4: 1.17x is in none"),
        ("Decode is 1.4x faster.", "line 1: 1.4x cites no results file"),
        ("A layer over 4% of H trains dense.", "line 1: 4% cites no results file"),
        ("Done in 41 s.", "line 1: 41 cites no results file"),
        (
            "[log](benchmarks/results/gone.log)",
            "line 1: cites benchmarks/results/gone.log, which does not exist",
        ),
    ],
)
def test_figures_not_in_their_files_fail(project: Path, readme_text: str, reported: str):
    assert any(p.startswith(reported) for p in problems(readme_text, project)), problems(readme_text, project)
