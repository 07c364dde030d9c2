"""The docs site cannot rot: it builds with warnings as errors (a control shows a broken link fails the build), the
generated reference covers every run-config key, CLI flag and task-contract member with its docstring, and every
shell block of the get-started and across-machines pages says whether a test runs it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest

from tests.conftest import REPO, load_script

MKDOCS = Path(sys.executable).parent / "mkdocs"
CHECKED_PAGES = ("get-started/demo.md", "get-started/running.md", "get-started/your-data-and-model.md",
                 "how-to/across-machines.md")
RUN_BY = re.compile(r"<!-- run by: (tests/[\w/]+\.py)::(\w+) -->")
NOT_RUN = re.compile(r"^# not run by the tests: \S")


@pytest.fixture(scope="module")
def reference():
    return load_script("nebula_docs_reference", REPO / "docs" / "hooks" / "reference.py")


def _build(root: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(MKDOCS), "build", "--strict", "--config-file", str(root / "mkdocs.yml"), "--site-dir",
                           str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, cwd=root)


def test_the_site_builds_with_warnings_as_errors_and_a_broken_link_fails_it(tmp_path):
    built = _build(REPO, tmp_path / "site")
    assert built.returncode == 0, built.stderr[-3000:]
    for page in ("index.html", "reference/config.html", "reference/cli.html", "reference/plugins.html",
                 "how-to/across-machines.html"):
        assert (tmp_path / "site" / page).is_file(), page
    # the control: the same site with one broken link does not build
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "get-started" / "demo.md"
    page.write_text(page.read_text() + "\nSee [the missing page](../how-to/no-such-page.md).\n")
    broken = _build(copy, tmp_path / "broken")
    assert broken.returncode != 0 and "no-such-page.md" in broken.stderr


def test_every_key_flag_and_contract_member_is_in_the_generated_reference_with_its_docstring(reference):
    from nebula_fl.config import RunConfig
    from nebula_fl.tasks import TASKS

    assert reference.undocumented() == []
    config = reference.config_page()
    keys = [*RunConfig.known_keys(), *(k for task in TASKS._builtins().values() for k in task.Options.flat_keys())]
    assert len(keys) > 80 and all(f"| `{key}` |" in config for key in keys), [k for k in keys if f"`{k}`" not in config]
    cli = reference.cli_page()
    flags = [(name, option) for name, command in reference.commands().items() for action in command._actions
             if action.help != "==SUPPRESS==" for option in action.option_strings if option not in ("-h", "--help")]
    assert len(flags) > 60 and all(option in cli for _, option in flags)
    assert all(f"## `nebula-fl {name}`" in cli for name in reference.commands())
    plugins = reference.plugins_page()
    assert all(f"| `{member}` |" in plugins for member in ("build_model", "examples", "loss", "evaluate",
                                                           "exchange", "privacy_modes", "defaults"))


def test_a_key_without_a_docstring_is_caught(reference):
    """The control for the check above: a section with an undocumented field is reported."""
    from dataclasses import dataclass

    from nebula_fl.config import Section

    @dataclass(kw_only=True, frozen=True)
    class Probe(Section):
        PREFIX: ClassVar[str] = "probe"
        documented: int = 1
        """Said."""
        silent: int = 2

    rows = {r["key"]: r["doc"] for r in reference.section_rows(Probe)}
    assert rows == {"probe.documented": "Said.", "probe.silent": ""}


@pytest.mark.parametrize("page", CHECKED_PAGES)
def test_every_shell_block_says_whether_a_test_runs_it(page):
    """A block run by a test names the test, which must exist and quote the block's command; any other says why
    it is not run, in its first line."""
    text = (REPO / "docs" / page).read_text()
    blocks = list(re.finditer(r"(?:(<!-- run by: [^>]+ -->)\n)?```bash\n(.*?)```", text, flags=re.S))
    assert blocks, page
    for match in blocks:
        marker, body = match.group(1), match.group(2)
        if marker:
            test_file, test_name = RUN_BY.match(marker).groups()
            source = (REPO / test_file).read_text()
            assert f"def {test_name}(" in source, (page, marker)
            assert "docs_block(" in source, f"{test_file} does not read its command from {page}"
        else:
            assert NOT_RUN.match(body), f"{page}: a block neither run by a test nor saying why not:\n{body[:300]}"


def test_the_recipe_for_testing_a_task_without_a_federation_runs(capsys):
    """The how-to's recipe, executed as the page writes it."""
    text = (REPO / "docs" / "how-to" / "writing-a-task.md").read_text()
    code = re.search(r"test_the_recipe_for_testing_a_task_without_a_federation_runs -->\n```python\n(.*?)```", text,
                     flags=re.S).group(1)
    exec(compile(code, "writing-a-task.md", "exec"), {"__name__": "recipe"})
    printed = capsys.readouterr().out
    assert "'accuracy'" in printed and "values exchanged" in printed
