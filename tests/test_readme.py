"""The README's code runs as written, CI runs the README's test command, and the stacks' quick
examples in docs/integrations.md run as written."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
INTEGRATIONS = (ROOT / "docs" / "integrations.md").read_text()


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_readme_gives_the_main_job_and_the_tests_as_two_commands_and_ci_runs_the_test_one():
    block = re.search(r"```bash\n(.*?)```", _section(README, "The main job and the tests"), re.S)
    lines = block.group(1).strip().splitlines()
    assert len(lines) == 2
    assert "dobb-bench compare" in lines[0]
    assert lines[1] in (ROOT / ".ci" / "run").read_text()


def test_readme_shape():
    lines = README.splitlines()
    assert len(lines) <= 160
    start = next(i for i, x in enumerate(lines) if x.startswith("```python"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    assert start < 45 and end - start - 1 <= 15  # the quickstart: early and short


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, "README.md", "exec"), namespace)
    model = namespace["model"]
    assert all(p.isfinite().all() for p in model.parameters())


def test_integrations_quick_examples_show_and_run_each_stack():
    section = _section(INTEGRATIONS, "Quick examples")
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    joined = "\n".join(blocks)
    for module in ("dobb.integrations.hf", "dobb.integrations.lightning", "dobb.integrations.torchtitan"):
        assert f"from {module} import" in joined, module
    namespace: dict = {}
    for code in blocks:
        exec(compile(code, "docs/integrations.md", "exec"), namespace)
    assert all(p.isfinite().all() for p in namespace["model"].parameters())


def test_readme_answers_first_in_its_own_words():
    # the first section after Install is the answer: a table of at most six situations, each with
    # a build_optimizer call, and the scale of the evidence beside it
    after_install = README.split("\n## Install\n", 1)[1].split("\n## ", 1)[1]
    assert after_install.startswith("Which optimizer")
    section = after_install.split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| ") and "build_optimizer(" in r]
    assert 3 <= len(rows) <= 6
    assert "0.43M parameters" in section and "projected" in section
    # no project bookkeeping above "More": issue numbers, study names, table ids, Findings items
    above = README.split("\n## More\n", 1)[0]
    for pattern in (r"\bissues? \d", r"\bstudy\b", r"table:", r"Findings item"):
        assert not re.search(pattern, above), pattern


def test_readme_calls_name_registered_optimizers_with_valid_options():
    import ast

    import dobb
    section = README.split("\n## Which optimizer\n", 1)[1].split("\n## ", 1)[0]
    calls = re.findall(r"`build_optimizer\((.*?)\)`", section)
    assert calls
    for call in calls:
        tree = ast.parse(f"f({call})").body[0].value
        name = ast.literal_eval(tree.args[0])
        kwargs = {k.arg: ast.literal_eval(k.value) for k in tree.keywords}
        kwargs.pop("lr")
        dobb.registry.validate(name, kwargs)  # a renamed option or optimizer fails here
