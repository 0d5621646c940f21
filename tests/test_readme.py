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
