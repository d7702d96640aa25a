"""The documentation builds, its links resolve, and the README stays a front door.

* the site builds with ``mkdocs build --strict`` (mkdocs.yml: links to pages and anchors are checked,
  and a warning fails the build), and a broken anchor does fail it;
* every relative link in README.md and docs/**/*.md points at a file that exists (mkdocs does not look
  at README.md, nor at links that leave docs/);
* docs/reference/ is what ``tools/gen_reference.py`` writes from the code today;
* the README is at most 200 lines, its ``bidikv`` commands parse, and no Markdown file cites internal
  issue numbers.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README_MAX_LINES = 200



# --- relative links -------------------------------------------------------------------------------

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(text: str) -> list[str]:
    """Link targets of a Markdown text that are neither URLs nor in-page anchors, outside code."""
    text = _INLINE_CODE.sub("", _FENCE.sub("", text))
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target)
    return targets


def broken_links(path: pathlib.Path) -> list[str]:
    """The relative links of a Markdown file whose target file does not exist."""
    broken = []
    for target in relative_links(path.read_text()):
        file_part = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (ROOT / file_part.lstrip("/")) if file_part.startswith("/") else (path.parent / file_part)
        if not resolved.exists():
            broken.append(target)
    return broken


def _markdown_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_bidikv_commands_parse():
    import shlex

    from impl.cli import build_parser

    text = (ROOT / "README.md").read_text()
    commands = [line.split(" #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
                for line in block.splitlines() if line.startswith("bidikv ")]
    assert len(commands) >= 3  # one per job
    for command in commands:
        try:
            build_parser().parse_args(shlex.split(command)[1:])
        except SystemExit as e:  # argparse's way of refusing a command line
            pytest.fail(f"README command does not parse ({e.code}): {command}")


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_link_checker_flags_broken_links(tmp_path):
    (tmp_path / "there.md").write_text("# there\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok too](there.md#there) [gone](missing.md) ![img](nope.png)\n"
                    "[web](https://example.com/x.md) [anchor](#here) `[code](not-a-link.md)`\n"
                    "```\n[fenced](also-not.md)\n```\n")
    assert broken_links(page) == ["missing.md", "nope.png"]


def test_no_internal_issue_numbers_in_markdown():
    hits = []
    for path in [*ROOT.glob("*.md"), *(p for d in ("docs", "impl", "sim", "calibration", "benchmarks",
                                                  "notebooks", "tools") for p in (ROOT / d).rglob("*.md"))]:
        if "CHANGELOG" in path.name:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"issue [0-9]+", line, re.I):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert hits == []


# --- the site -------------------------------------------------------------------------------------

def _build(config: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess:
    for module in ("mkdocs", "material"):  # the test extra (pip install -e '.[test]')
        pytest.importorskip(module, reason="the site needs mkdocs and mkdocs-material (the test extra)")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                           "-f", str(config), "-d", str(site)],
                          cwd=config.parent, env=env, capture_output=True, text=True, timeout=300)


def test_site_builds_strict(tmp_path):
    run = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert run.returncode == 0, run.stdout + run.stderr
    for page in ("index.html", "guides/simulate/index.html", "reference/cli/index.html",
                 "reference/metrics/index.html", "results/index.html"):
        assert (tmp_path / "site" / page).exists(), page


def test_strict_build_fails_on_a_broken_anchor(tmp_path):
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", copy / "docs")
    with open(copy / "docs" / "index.md", "a") as f:
        f.write("\n[nowhere](guides/simulate.md#no-such-heading)\n")
    run = _build(copy / "mkdocs.yml", tmp_path / "site")
    assert run.returncode != 0
    assert "no-such-heading" in run.stdout + run.stderr


# --- the generated reference ----------------------------------------------------------------------

def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_reference_is_current():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "tools/gen_reference.py", "--check"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


def test_staleness_check_names_changed_missing_and_extra_pages(tmp_path):
    gen = _generator()
    pages = {"cli.md": "a\n", "router.md": "b\n", "metrics.md": "c\n"}
    (tmp_path / "cli.md").write_text("a\n")
    (tmp_path / "router.md").write_text("b, edited by hand\n")
    (tmp_path / "old.md").write_text("a page the generator no longer writes\n")
    assert gen.stale_pages(pages, tmp_path) == ["router.md", "metrics.md", "old.md"]
    assert gen.stale_pages({"cli.md": "a\n"}, tmp_path / "none") == ["cli.md"]


# --- results pages whose tables a benchmark writes ----------------------------------------------

def _learnt_benchmark():
    spec = importlib.util.spec_from_file_location("learnt_retention_benchmark", ROOT / "benchmarks/learnt_retention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_learnt_retention_page_holds_the_benchmarks_tables():
    bench = _learnt_benchmark()
    page = (ROOT / "docs/results/learnt-retention.md").read_text()
    assert page.count(bench.BEGIN) == 1 and page.count(bench.END) == 1
    generated = page.split(bench.BEGIN, 1)[1].split(bench.END, 1)[0]
    assert "Generated by `python benchmarks/learnt_retention.py" in generated and "| learnt |" in generated


def test_the_decode_memory_page_holds_the_benchmarks_table():
    from benchmarks.generated_section import markers

    begin, end = markers("benchmarks/decode_memory.py")
    page = (ROOT / "docs/results/decode-memory.md").read_text()
    assert page.count(begin) == 1 and page.count(end) == 1
    generated = page.split(begin, 1)[1].split(end, 1)[0]
    assert "Generated by `python benchmarks/decode_memory.py" in generated
    for row in ("| pinned ttl=480s |", "| give_back ttl=3600s |", "| instant_drop ttl=3600s |", "| oracle (pinned) |"):
        assert row in generated, row


def test_the_benchmark_rewrites_only_its_section_and_refuses_a_page_without_markers(tmp_path):
    from benchmarks.generated_section import markers, write_between_markers

    begin, end = markers("benchmarks/x.py")
    page = tmp_path / "page.md"
    page.write_text(f"# T\n\nbefore\n\n{begin}\nold table\n{end}\n\nafter\n")
    write_between_markers(page, "new table\n", "benchmarks/x.py")
    assert page.read_text() == f"# T\n\nbefore\n\n{begin}\nnew table\n{end}\n\nafter\n"
    for bad in ("# no markers\n", f"{end}\n{begin}\n", f"{begin}\n{end}\n{begin}\n{end}\n",
                f"{markers('benchmarks/other.py')[0]}\n{end}\n"):
        bare = tmp_path / "bare.md"
        bare.write_text(bad)
        with pytest.raises(SystemExit, match="needs one"):
            write_between_markers(bare, "x\n", "benchmarks/x.py")
        assert bare.read_text() == bad  # a refused page is left as it was


# --- headlines: a figure quoted on several pages is one text, written by one script ----------------

_HEADLINE = re.compile(r"<!-- headline ([a-z0-9-]+): begin -->(.*?)<!-- headline \1: end -->")


def _headlines() -> dict[str, dict[str, str]]:
    """headline name -> {page: its text there}."""
    found: dict[str, dict[str, str]] = {}
    for path in _markdown_files():
        for name, text in _HEADLINE.findall(path.read_text()):
            found.setdefault(name, {})[str(path.relative_to(ROOT))] = text
    return found


def test_every_quoted_headline_is_one_text_with_one_writer():
    from benchmarks.generated_section import HEADLINES

    found = _headlines()
    assert set(found) == set(HEADLINES), "a headline without a writer, or a writer nothing quotes"
    for name, copies in found.items():
        assert len(set(copies.values())) == 1, f"headline {name} differs between {sorted(copies)}"
        writer = HEADLINES[name]
        assert (ROOT / writer).exists(), writer
        if writer.endswith(".md"):  # kept by hand on the page that measures it: that page quotes it too
            assert writer in copies, f"headline {name}: its page {writer} does not hold it"
    for path in _markdown_files():  # an unpaired marker would be skipped by the writer
        text = path.read_text()
        assert text.count("<!-- headline ") == 2 * len(_HEADLINE.findall(text)), path


def test_write_headline_rewrites_every_copy_and_refuses_a_split_marker(tmp_path):
    from benchmarks.generated_section import headline_markers, write_headline

    begin, end = headline_markers("x")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(f"* a {begin}old{end} b\n")
    (tmp_path / "docs" / "i.md").write_text(f"| r | {begin}old{end} | l |\n| s | {begin}old{end} | m |\n")
    (tmp_path / "docs" / "other.md").write_text("untouched\n")
    pages = write_headline("x", "new, 1.5 %", tmp_path)
    assert sorted(p.name for p in pages) == ["README.md", "i.md"]
    assert (tmp_path / "README.md").read_text() == f"* a {begin}new, 1.5 %{end} b\n"
    assert (tmp_path / "docs" / "i.md").read_text() == f"| r | {begin}new, 1.5 %{end} | l |\n| s | {begin}new, 1.5 %{end} | m |\n"
    (tmp_path / "README.md").write_text(f"{begin}old\n{end}\n")
    with pytest.raises(SystemExit, match="same line"):
        write_headline("x", "new", tmp_path)
    with pytest.raises(ValueError, match="one line"):
        write_headline("x", "two\nlines", tmp_path)


def _generated(page: str, script: str) -> str:
    from benchmarks.generated_section import markers

    begin, end = markers(script)
    return (ROOT / page).read_text().split(begin, 1)[1].split(end, 1)[0]


def _number(cell: str) -> float:
    return float(cell.replace(",", "").split()[0])


def test_the_decode_memory_headline_is_what_the_benchmark_writes_from_its_table():
    """The quoted sentence is decode_memory.headline() of the rows in the page's generated table."""
    from benchmarks import decode_memory

    rows = []
    for line in _generated("docs/results/decode-memory.md", "benchmarks/decode_memory.py").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != 7 or not cells[1][:1].isdigit():
            continue
        p50, p90 = (_number(x) for x in cells[1].split("/"))
        figures = {"ttft_p50_ms": p50, "ttft_p90_ms": p90, "d_wait_total_s": _number(cells[3]),
                   "preemptions": int(_number(cells[4]))}
        rows.append((cells[0], figures, _number(cells[6]), _number(cells[5])))
    assert len(rows) >= 4
    cluster = re.search(r"; (\d+P\d+D, [^,]+), ", _generated("docs/results/decode-memory.md",
                                                            "benchmarks/decode_memory.py")).group(1)
    assert _headlines()["decode-memory"]["README.md"] == decode_memory.headline(cluster, rows)


def test_the_learnt_retention_headline_is_what_the_benchmark_writes_from_its_table():
    from benchmarks import learnt_retention

    summary_rows = []
    for line in _generated("docs/results/learnt-retention.md", "benchmarks/learnt_retention.py").splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0].endswith(("1P1D", "4P4D")) and cells[2][:1].isdigit():
            summary_rows.append((cells[0], (_number(cells[2]), cells[1]), {"share": _number(cells[3])}))
    assert any(name.startswith("mooncake") for name, _, _ in summary_rows)
    budget = float(re.search(r"budget (\d+(?:\.\d+)?) %", _generated("docs/results/learnt-retention.md",
                                                                    "benchmarks/learnt_retention.py")).group(1))
    assert _headlines()["learnt-retention"]["README.md"] == learnt_retention.headline(budget, summary_rows)
